"""Every relative link and every raw-result path named in README.md and docs/**/*.md exists.

Raw results move into dated folders and old ones are deleted; this keeps a page from pointing at a
file that is no longer there. Checked: markdown links `[text](target)` that are not URLs (the file,
and the heading when the target has `#anchor`), and every `docs/benchmarks/...` or `benchmarks/...`
path written in the text (both name a file under docs/benchmarks/; `{a,b}` and `*` are expanded),
and every raw-result file named bare (`<what>_h200_<date>....json`), which must be somewhere under it.
A path after `<commit>:` names a file in git history (a removed raw file) and is not checked.
Source files that cite a raw result (a kernel's launch-config sweep) are held to the same rule.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
BENCHMARK_PATH = re.compile(r"(?<![\w/.:-])(?:docs/)?benchmarks/([\w./{},*-]*)")
RAW_FILE_NAME = re.compile(r"(?<![\w/.:-])([a-z0-9_]+_(?:h200|\d+xh200|cpu)_\d{4}-\d{2}-\d{2}[\w.-]*\.(?:jsonl?|txt))")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SOURCE_DIRS = ("core", "fused_kernels", "models", "data", "multimodal", "scripts")


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def source_files(root: Path) -> list[Path]:
    return sorted(p for d in SOURCE_DIRS if (root / d).is_dir() for p in (root / d).rglob("*.py"))


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors: set[str] = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


def expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for alt in match.group(1).split(",") for p in expand_braces(head + alt + tail)]


def dead_benchmark_paths(text: str, where: Path, root: Path) -> list[str]:
    dead = []
    for rest in BENCHMARK_PATH.findall(text):
        for name in expand_braces(rest.rstrip(".,")):
            if not any((root / "docs" / "benchmarks").glob(name) if name else [True]):
                dead.append(f"{where}: names missing docs/benchmarks/{name}")
    return dead


def dead_in_page(page: Path, root: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(root)
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            dead.append(f"{where}: link to missing {target}")
        elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked):
            dead.append(f"{where}: link to missing heading {target}")
    dead += dead_benchmark_paths(text, where, root)
    raw_files = {p.name for p in (root / "docs" / "benchmarks").rglob("*")}
    for name in RAW_FILE_NAME.findall(text):
        if name not in raw_files:
            dead.append(f"{where}: names {name}, in no folder of docs/benchmarks")
    return dead


def dead_in_sources(root: Path) -> list[str]:
    dead = []
    for source in source_files(root):
        text = source.read_text(encoding="utf-8")
        if "benchmarks/" in text:
            dead += dead_benchmark_paths(text, source.relative_to(root), root)
    return dead


def dead_links(root: Path) -> list[str]:
    return dead_in_sources(root) + [d for page in doc_pages(root) for d in dead_in_page(page, root)]


@pytest.mark.parametrize("page", doc_pages(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_benchmark_path_in_a_page_exists(page):
    dead = dead_in_page(page, ROOT)
    assert not dead, "dead references (move the reference with the file):\n" + "\n".join(dead)


def test_every_benchmark_path_in_the_sources_exists():
    dead = dead_in_sources(ROOT)
    assert not dead, "dead references (move the reference with the file):\n" + "\n".join(dead)


def test_the_check_finds_a_dead_link_a_dead_heading_and_a_missing_raw_file(tmp_path):
    (tmp_path / "docs" / "benchmarks" / "2026-01-01").mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks" / "2026-01-01" / "a_h200.json").write_text("{}")
    (tmp_path / "docs" / "other.md").write_text("# Other\n## A `code` heading, too\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "tool.py").write_text('"""Configs from docs/benchmarks/2026-01-01/gone.json."""\n')
    (tmp_path / "README.md").write_text(
        "[ok](docs/other.md#a-code-heading-too) [gone](docs/missing.md) [bad](docs/other.md#nope)\n"
        "`docs/benchmarks/2026-01-01/{a,b}_h200.json` `benchmarks/2026-01-01/a_*.json`\n"
        "`a_h200_2026-01-01.json` was removed; `b_2b_h200_2026-01-01_ab.json` too\n"
        "in history: `33a3702^:docs/benchmarks/c_h200_2026-01-01.json`\n"
    )
    assert dead_links(tmp_path) == [
        "scripts/tool.py: names missing docs/benchmarks/2026-01-01/gone.json",
        "README.md: link to missing docs/missing.md",
        "README.md: link to missing heading docs/other.md#nope",
        "README.md: names missing docs/benchmarks/2026-01-01/b_h200.json",
        "README.md: names a_h200_2026-01-01.json, in no folder of docs/benchmarks",
        "README.md: names b_2b_h200_2026-01-01_ab.json, in no folder of docs/benchmarks",
    ]
