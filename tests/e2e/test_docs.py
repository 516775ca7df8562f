"""The documentation: the site builds in strict mode (a broken link, a missing page or an API reference that fails to
resolve is an error), its references are generated from the code, and the README stays a front page."""
import os
import re
import subprocess
import sys

from tests.helpers import ROOT


def test_site_builds_strictly_with_generated_references(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text()
    # every recipe's options and every benchmark, from the parsers themselves
    for text in ("recipe charlm", "recipe regression", "recipe imagenet", "--early-stop", "--lr-per-256",
                 "bench network", "bench convergence"):
        assert text in cli, text
    api = (site / "reference" / "api" / "index.html").read_text()
    for text in ("split_batch", "MeanSquaredError", "Perplexity", "TrainConfig", "ShardSampler", "on_epoch_end",
                 "eval_step", "monitor"):
        assert text in api, text


def test_readme_is_a_front_page_whose_links_reach_the_docs():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 10
    for link in links:
        assert os.path.isfile(os.path.join(ROOT, link)), link
