"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#fragment`` names a
heading of the target as GitHub spells its anchor. A ``docs/NAME.md`` mentioned in running text exists too."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MENTION = re.compile(r"(?<![\w/.-])docs/[\w.-]+\.md\b")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (not ``-`` or ``_``), spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings (outside code blocks); repeats get GitHub's ``-1``, ``-2`` suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = anchor(match.group(1))
            found.add(f"{base}-{seen[base]}" if base in seen else base)
            seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that do not resolve, each as 'page: target (why)'."""
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        name = page.relative_to(ROOT)
        if not resolved.exists():
            broken.append(f"{name}: {target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{name}: {target} (no heading with that anchor)")
    for mention in MENTION.findall(text):
        if not (ROOT / mention).exists():
            broken.append(f"{page.relative_to(ROOT)}: {mention} (mentioned, no such file)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page)


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title: `x` (y)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#a-title-x-y) [ok](a.md#twice-1) [ok](https://example.com/x.md)\n"
                    "[gone](missing.md) [bad](a.md#nope)\n```\n[in code](missing.md)\n```\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["docs/b.md: missing.md (no such file)",
                                      "docs/b.md: a.md#nope (no heading with that anchor)"]
    finally:
        ROOT = saved


def test_anchor_is_githubs():
    assert anchor("Megatron-LM's own checkpoint (`--ckpt-format torch_dist`) through install()") == \
        "megatron-lms-own-checkpoint---ckpt-format-torch_dist-through-install"
    assert anchor("Model-parallel checkpoints (TP / PP)") == "model-parallel-checkpoints-tp--pp"
