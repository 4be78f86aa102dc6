"""The repository must not point at files outside itself: no paths into a sibling `shared/`
checkout or a research folder, no notes that are not in the repository, and every relative
link of a Markdown page and every `docs/*.md` a file names must exist."""
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "build", "dist",
             "out", "gpu_check_out", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ""}
# Third-party data quoting other projects' READMEs and URLs; no path of ours in there.
SKIP_FILES = {"tests/data/vllm_public/bench_runs.yaml", "tests/data/vllm_public/startup_logs.yaml"}

# Notes that lived beside the repository while it was written; the docs/ pages replace them.
OUTSIDE_NOTES = ("ARCHITECTURE", "PRIMER", "STYLE", "TOOLCHAIN", "VLLM_SEMANTICS", "PUBLIC_VLLM_DATA")
OUTSIDE = [
    re.compile(r"\.\./+shared\b"),
    re.compile(r"\bshared/(?:traces|research)\b"),
    re.compile(r"\bresearch/[\w.-]+\.md\b"),
    re.compile(r"/work/(?:shared|main|wt)\b"),
]
NOTE = re.compile(r"\b(?:%s)\.md\b" % "|".join(OUTSIDE_NOTES))
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+\.md\b")   # (not a path inside a URL)
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def text_files(root: Path = ROOT) -> list[Path]:
    """The repository's text files, not descending into environments, caches or run folders."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            path = Path(folder) / name
            rel = path.relative_to(root).as_posix()
            if path.suffix not in TEXT_SUFFIXES or rel in SKIP_FILES or name == ".git":
                continue
            if path.is_symlink() or path.stat().st_size > 2_000_000:
                continue
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            out.append(path)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text, fence, found = page.read_text(encoding="utf-8"), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            found.add(slug(m.group(1)))
    return found


def outside_references(path: Path, root: Path = ROOT) -> list[str]:
    """'file:line: what' for every reference in `path` to something outside the repository."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix()
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern in OUTSIDE:
            for m in pattern.finditer(line):
                problems.append(f"{rel}:{n}: {m.group(0)!r} points outside the repository")
        for m in NOTE.finditer(line):
            if not list(root.glob(f"**/{m.group(0)}")):
                problems.append(f"{rel}:{n}: {m.group(0)} is not in the repository")
    return problems


def missing_docs(path: Path, root: Path = ROOT) -> list[str]:
    """Every docs/*.md a file names must exist (HTML comments in Markdown are notes, not links)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        text = HTML_COMMENT.sub("", text)
    rel = path.relative_to(root).as_posix()
    return [f"{rel}: names {m.group(0)}, which does not exist" for m in DOCS_PATH.finditer(text)
            if not (root / m.group(0)).is_file()]


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Relative Markdown links whose file, or whose #anchor in that file, does not exist."""
    text = HTML_COMMENT.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    rel = page.relative_to(root).as_posix()
    problems = []
    for m in MD_LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists() or root not in dest.parents and dest != root:
            problems.append(f"{rel}: link {target} has no file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel}: link {target} has no such heading")
    return problems


FILES = text_files()


def test_the_scan_sees_the_repository():
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"README.md", "sim/scenario.py", "docs/architecture.md"} <= names


def test_nothing_points_outside_the_repository():
    this = Path(__file__).resolve()
    problems = [p for f in FILES if f.resolve() != this for p in outside_references(f)]
    assert not problems, "\n".join(problems)


def test_every_named_docs_page_exists():
    this = Path(__file__).resolve()
    problems = [p for f in FILES if f.resolve() != this for p in missing_docs(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [f for f in FILES if f.suffix == ".md"],
                         ids=lambda f: f.relative_to(ROOT).as_posix())
def test_markdown_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_look_for(tmp_path):
    (tmp_path / "docs").mkdir()
    bad = tmp_path / "m.py"
    bad.write_text('"""As in research/' 'VLLM_SEMANTICS.md; see ../' 'shared/traces and docs/nope.md."""\n')
    page = tmp_path / "docs" / "a.md"
    page.write_text("# Title\n\n[x](b.md) [y](#title) [z](#gone) [w](https://example.com)\n")
    assert len(outside_references(bad, tmp_path)) == 4
    assert missing_docs(bad, tmp_path) == ["m.py: names docs/nope.md, which does not exist"]
    assert broken_links(page, tmp_path) == ["docs/a.md: link b.md has no file in the repository",
                                            "docs/a.md: link #gone has no such heading"]


LEFTOVER_SUFFIXES = (".orig", ".rej")                 # what `patch` and a merge tool leave beside a file
CONFLICT_MARKER = re.compile(r"^(?:<{7}|>{7}) ", re.M)


def leftovers(root: Path) -> list[str]:
    """Files a patch or merge left behind, and text files still holding conflict markers."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out += [f"{(Path(folder) / n).relative_to(root).as_posix()}: a patch's or merge's leftover"
                for n in sorted(files) if n.endswith(LEFTOVER_SUFFIXES)]
    for path in text_files(root):
        if CONFLICT_MARKER.search(path.read_text(errors="replace")):
            out.append(f"{path.relative_to(root).as_posix()}: a merge conflict's markers")
    return out


def test_no_merge_or_patch_leftovers():
    problems = leftovers(ROOT)
    assert not problems, "\n".join(problems)


def test_the_leftover_scan_finds_both_kinds(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "log.md.orig").write_text("old\n")
    (tmp_path / "docs" / "log.md").write_text("a\n<<<<<<< HEAD\nb\n=======\nc\n>>>>>>> branch\n")
    (tmp_path / "docs" / "fine.md").write_text("a table rule\n=======\n")
    assert sorted(leftovers(tmp_path)) == ["docs/log.md.orig: a patch's or merge's leftover",
                                           "docs/log.md: a merge conflict's markers"]
