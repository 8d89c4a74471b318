"""Packaging metadata: one version, PEP 639 license, the dependencies the README promises."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import vgraph

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_is_written_once(project):
    assert "version" not in project and "version" in project["dynamic"]
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["dynamic"]["version"] == {"attr": "vgraph.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", vgraph.__version__)


def test_license_is_pep_639_and_the_file_exists(project):
    assert project["license"] == "MIT"  # an SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "The vgraph authors" in text
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639 forbids both


def test_numpy_only_as_the_readme_says(project):
    assert [re.split(r"[<>=]", d)[0] for d in project["dependencies"]] == ["numpy"]
    assert "numpy only" in (ROOT / "README.md").read_text()
    assert any(d.startswith("tqdm") for d in project["optional-dependencies"]["progress"])


def test_no_project_urls_until_the_project_has_a_public_home(project):
    """Placeholder links 404 on the package page; see docs/decisions.md, "Packaging metadata"."""
    assert "urls" not in project


def _guarded(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside a ``try`` whose handlers catch ImportError (optional imports:
    the code runs without the module)."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is not None
            and {getattr(t, "id", None) for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])}
            & {"ImportError", "ModuleNotFoundError"}
            for h in node.handlers
        ):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return guarded


def _third_party_imports() -> dict[str, dict[str, bool]]:
    """Top-level modules imported anywhere the test suite runs (vgraph/, tests/, tools/, examples/;
    function-local imports included) that are neither standard library nor the project's own:
    for each, the files importing it and whether every import there is optional (under a
    ``try`` that catches ImportError)."""
    import sys

    roots = [ROOT / d for d in ("vgraph", "tests", "tools", "examples")]
    local = {p.stem for r in roots for p in r.rglob("*.py")} | {"vgraph"}
    found: dict[str, dict[str, bool]] = {}
    for r in roots:
        for path in r.rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            guarded = _guarded(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        files = found.setdefault(top, {})
                        where = str(path.relative_to(ROOT))
                        files[where] = files.get(where, True) and id(node) in guarded
    return found


def test_the_test_extra_alone_runs_the_suite_and_mypy(project):
    """`pip install -e ".[test]"` must be enough for the suite (which runs the examples and tools)
    and for mypy, which checks vgraph's optional imports against their own annotations: every
    third-party module imported where the suite runs comes from the dependencies or the test extra,
    or is optional where it is imported (a benchmark's PyTorch columns) and offered by another extra."""
    from importlib.metadata import packages_distributions

    def dist(requirement: str) -> str:
        return re.split(r"[<>=\[; ]", requirement)[0].lower().replace("_", "-")

    extras = project["optional-dependencies"]
    provided = {dist(r) for r in project["dependencies"] + extras["test"]}
    offered = {dist(r) for name, reqs in extras.items() if name != "test" for r in reqs}
    module_dists = packages_distributions()
    missing = {}
    for module, files in _third_party_imports().items():
        dists = {d.lower().replace("_", "-") for d in module_dists.get(module, [module])}
        if dists & provided or (all(files.values()) and dists & offered):
            continue
        missing[module] = sorted(files)
    assert not missing, f"imported but not in the test extra (nor optional and in another extra): {missing}"
