"""MkDocs hook: the command-line reference, generated from hvdtrain's own parsers and usage texts at build time."""
from __future__ import annotations

import contextlib
import io

MARKER = "<!-- generated: cli -->"


def _captured(fn, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            fn(*args)
        except SystemExit:  # argparse's --help
            pass
    return out.getvalue().rstrip()


def _block(title: str, text: str) -> str:
    return f"## {title}\n\n```text\n{text}\n```\n"


def cli_reference() -> str:
    from hvdtrain import cli, raylaunch, registry, shards
    from hvdtrain.bench import BENCHMARKS, main as bench_main
    from hvdtrain.config import help_text
    parts = [_block("python -m hvdtrain", cli.usage().rstrip())]
    for name in registry.available():
        parts.append(_block(f"recipe {name}", help_text(registry.load(name).config_class, name)))
    parts.append(_block("eval", cli.EVAL_USAGE))
    parts.append(_block("export", cli.EXPORT_USAGE))
    parts.append(_block("data", shards.DATA_USAGE))
    parts.append(_block("ray", raylaunch.USAGE))
    parts.append(_block("report", _captured(cli.cmd_report, ["--help"])))
    parts.append(_block("doctor", _captured(cli.cmd_doctor, ["--help"])))
    parts.append(_block("bench", _captured(bench_main, ["--help"])))
    for name in BENCHMARKS:
        parts.append(_block(f"bench {name}", _captured(bench_main, [name, "--help"])))
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
