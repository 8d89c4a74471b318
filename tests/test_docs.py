"""Every Python code block of README.md and docs/*.md runs, as printed.

Blocks of one file run in order in one namespace (a later block continues an earlier example),
in a temporary directory (blocks write checkpoints and pictures). A block that is deliberately
partial is skipped when it is marked, either by an HTML comment on the line just before its
opening fence::

    <!-- no-run -->
    ```python

or by a first line ``# not run: <reason>``. A file whose examples continue another file's (e.g.
the README's model) says so with ``<!-- continues README.md -->`` (a path from the repository
root): that file's blocks run first, in the same namespace. Files are discovered by glob, so new
documentation is tested as soon as it exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NO_RUN_COMMENT = "<!-- no-run -->"
CONTINUES = re.compile(r"^<!-- continues (\S+) -->\s*$", re.M)


def chain(path: Path) -> list[Path]:
    """``path`` preceded by the files it continues (followed iteratively), earliest first."""
    files = [path]
    while True:
        m = CONTINUES.search(files[0].read_text(encoding="utf-8"))
        if not m:
            return files
        prev = ROOT / m.group(1)
        assert prev.is_file(), f"{files[0].name} continues {m.group(1)}, which does not exist"
        assert prev not in files, f"a cycle of 'continues' markers: {[f.name for f in files]}"
        files.insert(0, prev)


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(first line number of the code, code, skipped) for every ```python block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if lang in ("python", "py"):
            code = "\n".join(lines[start:end]) + "\n"
            before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            first = code.lstrip().splitlines()[0] if code.strip() else ""
            skipped = before == NO_RUN_COMMENT or first.startswith("# not run:")
            blocks.append((start + 1, code, skipped))
        i = end + 1
    return blocks


def test_the_docs_are_discovered_by_glob():
    names = {p.name for p in DOCS}
    assert {
        "README.md",
        "modelling.md",
        "training.md",
        "rendering.md",
        "performance.md",
        "decisions.md",
    } <= names
    assert sum(len(python_blocks(p)) for p in DOCS) >= 10


def test_the_modelling_guide_runs_every_block_and_lists_every_function():
    """docs/modelling.md is where users look first: none of its blocks is skipped, it covers the
    loop stopping rules, and its table names every public function of vgraph.functions."""
    import vgraph as vg

    guide = ROOT / "docs" / "modelling.md"
    blocks = python_blocks(guide)
    assert len(blocks) >= 10 and not any(skipped for _, _, skipped in blocks)
    text = guide.read_text(encoding="utf-8")
    for construct in ("times=", "loop.step", "while_=", "until=", "max_iters", 'on_limit="stop"', "g.branch",
                      "g.recurse", "cg.trip_count", "cg.choice", "cg.capped", "cg.node", ".shape"):  # fmt: skip
        assert construct in text, construct
    functions = [n for n in vg.__all__ if getattr(getattr(vg, n), "__module__", None) == "vgraph.functions"]
    assert len(functions) > 30
    missing = [
        n for n in functions if f"vg.{n}(" not in text and f"vg.{n}`" not in text and f"vg.{n}," not in text
    ]
    assert not missing, f"docs/modelling.md's table lacks {missing}"


def test_continues_marker(tmp_path, monkeypatch):
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("```python\nx = 1\n```\n")
    b.write_text("<!-- continues a.md -->\n```python\ny = x\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert chain(b) == [a, b]


def test_block_extraction_and_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n```python\na = 1\n```\n\n<!-- no-run -->\n\n```python\nb = undefined\n```\n"
        "```sh\nmake test\n```\n```python\n# not run: needs a GPU\nc = 2\n```\n"
    )
    assert python_blocks(doc) == [(3, "a = 1\n", False), (9, "b = undefined\n", True),
                                  (15, "# not run: needs a GPU\nc = 2\n", True)]  # fmt: skip


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_python_block_runs(path, tmp_path, monkeypatch):
    import vgraph as vg

    monkeypatch.chdir(tmp_path)  # checkpoints, pictures and other files land here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    if not any(not skipped for _, _, skipped in python_blocks(path)):
        pytest.skip("no runnable Python block")
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for doc in chain(path):
        for line, code, skipped in python_blocks(doc):
            if skipped:
                continue
            # Padding makes tracebacks point at the line of the Markdown file.
            compiled = compile("\n" * (line - 1) + code, str(doc), "exec")
            try:
                exec(compiled, namespace)
            except vg.RenderError as e:
                if vg.render.dot_available():
                    raise
                pytest.skip(f"{doc.name}:{line} needs Graphviz's dot: {e}")
            except Exception as e:
                raise AssertionError(f"{doc.relative_to(ROOT)}: the block at line {line} fails: {e!r}") from e
