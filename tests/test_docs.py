"""The docs' links and the code's pointers into the docs lead somewhere.

A comment that cites a doc by a heading, or a doc that links another's section, breaks silently when the
heading is renamed: here it fails. Anchors follow GitHub's rule (lower case, punctuation dropped, spaces to
hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
SOURCES = sorted(p for d in ("pagedchat", "tests") for p in (ROOT / d).rglob("*")
                 if p.suffix in (".py", ".cpp", ".h") and p.is_file() and p != Path(__file__).resolve())

LINK = re.compile(r"\]\(([^)\s]+)\)")                         # [text](target)
CITED = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+)|`?,\s*\"([^\"]+)\")")  # docs/x.md#anchor or docs/x.md, "Heading"


def anchor(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def titles(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {m.strip().replace("`", "") for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_anchor_follows_githubs_rule():
    assert anchor("The app over a server (`pagedchat --server`)") == "the-app-over-a-server-pagedchat---server"
    assert anchor("The prompt's matmuls and attention's sums") == "the-prompts-matmuls-and-attentions-sums"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_resolve(doc):
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, frag = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif frag and file.suffix == ".md" and frag not in headings(file):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{doc.name}: {broken}"


def test_code_points_at_doc_headings_that_exist():
    broken = []
    for source in SOURCES:
        text = " ".join(source.read_text(encoding="utf-8", errors="replace").split())  # comments wrap lines
        for name, frag, title in CITED.findall(text):
            doc = ROOT / "docs" / name
            if not doc.exists():
                broken.append(f"{source.name}: docs/{name}")
            elif frag and frag not in headings(doc):
                broken.append(f"{source.name}: docs/{name}#{frag}")
            elif title and not any(t.startswith(title) for t in titles(doc)):
                broken.append(f"{source.name}: docs/{name}, {title!r}")
    assert not broken, broken
