"""Print the first error lines of a build log, each with the lines that explain it.

    python scripts/build_log_excerpt.py BUILD_LOG [--max-lines N]

A failed `pip wheel` of Horovod ends in setuptools' clean-up; the cause (a CMake error, a compiler's `error:`, a
Python traceback) is often hundreds of lines above the tail. scripts/build_horovod.sh prints this excerpt when a
build fails. Exit status 0 when an error line was found, 1 otherwise (the caller then shows the tail).
"""
from __future__ import annotations

import re
import sys
from typing import List

# A line that starts an explanation, and how many lines after it belong to it.
PATTERNS = [
    (re.compile(r"CMake Error"), 6),                      # CMake: the message follows on indented lines
    (re.compile(r"Could NOT find \w+"), 1),
    (re.compile(r"\b(fatal )?error: "), 3),               # gcc / nvcc / ld: the source line and caret follow
    (re.compile(r"^\s*Traceback \(most recent call last\)"), 40),  # up to the exception line (cut below)
    (re.compile(r"undefined reference to"), 1),
    (re.compile(r"^\s*\w+(\.\w+)*(Error|Exception): "), 0),
]
MAX_LINES = 60


def excerpt(lines: List[str], max_lines: int = MAX_LINES) -> List[str]:
    """The first error blocks of ``lines`` (numbered from 1 as "N: text"), at most ``max_lines`` lines in all."""
    out: List[str] = []
    taken = set()
    i = 0
    while i < len(lines) and len(out) < max_lines:
        line = lines[i]
        span = next((after for pattern, after in PATTERNS if pattern.search(line)), None)
        if span is None or i in taken:
            i += 1
            continue
        end = min(len(lines), i + 1 + span)
        if line.lstrip().startswith("Traceback"):  # to the exception line: the first unindented line after it
            end = next((j + 1 for j in range(i + 1, end) if lines[j] and not lines[j][0].isspace()), end)
        if out:
            out.append("...")
        for j in range(i, end):
            if j not in taken and len(out) < max_lines:
                out.append(f"{j + 1}: {lines[j].rstrip()}")
                taken.add(j)
        i = end
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    max_lines = int(argv[argv.index("--max-lines") + 1]) if "--max-lines" in argv else MAX_LINES
    with open(argv[0], errors="replace") as f:
        lines = f.read().splitlines()
    found = excerpt(lines, max_lines)
    if not found:
        return 1
    print(f"first error lines of {argv[0]} (line: text):")
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
