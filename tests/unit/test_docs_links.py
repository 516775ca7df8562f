"""Every relative link in the README and docs/ leads somewhere: the file exists, and a ``#section`` names a heading
of it as GitHub spells its anchor and, for a page of the site, as MkDocs spells it too (a renamed heading broke two
links to the --compile section unnoticed; then a link mended to GitHub's spelling failed ``mkdocs build --strict``,
whose anchors collapse a run of hyphens)."""
import glob
import os
import re

import pytest

from tests.helpers import ROOT
LINK = re.compile(r"\]\(([^)\s]*)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but hyphens dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def site_anchor(heading: str) -> str:
    """MkDocs' anchor of a heading (Python-Markdown's toc slugify, which mkdocs.yml keeps): as GitHub's, but with
    every run of hyphens and spaces one hyphen."""
    from markdown.extensions.toc import slugify
    return slugify(heading.strip().replace("`", ""), "-")


def anchors(path: str, spell=anchor):
    inside_code, found = False, set()
    with open(path) as f:
        for line in f:
            if line.startswith("```"):
                inside_code = not inside_code
            elif line.startswith("#") and not inside_code:
                found.add(spell(line.lstrip("#")))
    return found


def test_anchor_is_spelled_as_github_spells_it():
    assert anchor(" Compiling the model: `--compile` (PyTorch)") == "compiling-the-model---compile-pytorch"
    assert anchor("Three gradient sizes, on a loaded shared host (2026-12-04, evening)") == \
        "three-gradient-sizes-on-a-loaded-shared-host-2026-12-04-evening"
    assert site_anchor(" Compiling the model: `--compile` (PyTorch)") == "compiling-the-model-compile-pytorch"


DOCS = os.path.join(ROOT, "docs") + os.sep
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)) + [os.path.join(ROOT, "README.md")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_leads_to_a_file_and_a_heading(page):
    with open(page) as f:
        text = f.read()
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, s3: ...
            continue
        path, _, section = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(where):
            broken.append(f"{target} (no such file)")
        elif section and where.endswith(".md") and section not in anchors(where):
            broken.append(f"{target} (no such heading)")
        elif section and where.endswith(".md") and page.startswith(DOCS) and section not in anchors(where, site_anchor):
            broken.append(f"{target} (no such heading on the site: MkDocs spells its anchor otherwise)")
    assert not broken, f"{os.path.relpath(page, ROOT)}: " + ", ".join(broken)
