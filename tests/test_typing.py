"""Typing: vgraph ships its annotations (PEP 561) and the package is clean under its mypy config.

The mypy runs are opt-in (``VGRAPH_RUN_MYPY=1``, which CI sets in .ci/run): they take seconds, not
milliseconds. The checks of the marker and the metadata always run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import vgraph

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+

needs_mypy = pytest.mark.skipif(
    os.environ.get("VGRAPH_RUN_MYPY") != "1", reason="mypy runs only with VGRAPH_RUN_MYPY=1 (CI)"
)


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _mypy(*args: str, cwd: Path, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy")
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # vgraph is not installed: found as source
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "--no-color-output", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_py_typed_marker_is_shipped(pyproject):
    assert (ROOT / "vgraph" / "py.typed").is_file()
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["vgraph"]
    assert "Typing :: Typed" in pyproject["project"]["classifiers"]
    assert any(d.startswith("mypy") for d in pyproject["project"]["optional-dependencies"]["test"])


def test_public_api_modules_are_strict(pyproject):
    mypy = pyproject["tool"]["mypy"]
    strict = [o for o in mypy["overrides"] if o.get("disallow_untyped_defs")]
    assert len(strict) == 1
    modules = set(strict[0]["module"])
    # Every module a user imports public names from: the package and its top-level modules.
    top_level = {f"vgraph.{p.stem}" for p in (ROOT / "vgraph").glob("*.py") if not p.stem.startswith("_")}
    assert {"vgraph", "vgraph.render", "vgraph.virtual", *top_level} <= modules
    for flag in ("disallow_untyped_calls", "disallow_any_generics", "warn_return_any"):
        assert strict[0][flag] is True


def test_all_lists_every_public_name():
    """``vgraph.__all__`` is what ``mypy --strict`` accepts from ``from vgraph import X``: a public
    name missing from it is an error in every strictly typed user's code."""
    assert len(vgraph.__all__) == len(set(vgraph.__all__))
    for name in vgraph.__all__:
        assert hasattr(vgraph, name), name
    listed = set(vgraph.__all__)
    # Every public function, class and constant (`annotations` is the __future__ import).
    public = {
        n for n, v in vars(vgraph).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public - {"annotations"} == {
        n for n in listed if not isinstance(getattr(vgraph, n), types.ModuleType)
    }
    # The submodules `import vgraph` makes available as vgraph.nn, vgraph.render … (others, such as
    # vgraph.compute, become attributes only as a side effect of importing names from them).
    assert {"init", "io", "losses", "nn", "ops", "optim", "render", "tbptt"} <= listed


@needs_mypy
def test_the_package_is_mypy_clean(tmp_path_factory):
    result = _mypy("vgraph", cwd=ROOT, cache_dir=tmp_path_factory.mktemp("mypy_cache"))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_mypy
def test_strict_user_code_sees_the_public_names(tmp_path):
    """A user's code under ``mypy --strict``: the re-exported names resolve with their types, and a
    wrong call is caught (so vgraph's annotations are really used, not Any)."""
    user = tmp_path / "user.py"
    user.write_text(
        textwrap.dedent(
            """
            import numpy as np
            from vgraph import ComputeGraph, VirtualGraph, build_compute_graph, tanh
            from vgraph.render import to_dot

            g = VirtualGraph()
            y = tanh(g.input("x", (2,)))
            cg: ComputeGraph = build_compute_graph(g, {"x": np.zeros(2)}, y)
            text: str = to_dot(cg)
            wrong: int = to_dot(g)
            """
        )
    )
    result = _mypy(
        "--strict", "--follow-imports=silent", str(user), cwd=tmp_path, cache_dir=tmp_path / "cache"
    )
    out = result.stdout
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in out, out
    assert out.count("error:") == 1, out
