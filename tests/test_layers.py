"""The layering of DESIGN.md §2, read from every import of the package.

Layers, bottom first: the base (errors, the per-thread modes, recycled memory, initialisers),
``ops`` (primitives and the functions over them), ``compute`` (the engine and its compiled
sweeps), ``virtual`` (declaring and unrolling), and around them the modules that use the core
and not each other (nn, losses, optim, render, check, io, tbptt, cli). Every import counts —
top-level, inside a function, under ``TYPE_CHECKING`` — because each is a dependency the lower
layer cannot be used, tested or changed without.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vgraph"

LAYERS: dict[str, int] = {
    "errors": 0,
    "_files": 0,
    "modes": 0,
    "workspace": 0,
    "init": 0,
    "ops": 1,
    "functions": 1,
    "compute": 2,
    "tape": 2,
    "higher": 2,  # gradients recorded as nodes (second order): on ops and compute
    "virtual": 3,
    "nn": 4,
    "losses": 4,
    "optim": 4,
    "render": 4,
    "check": 4,
    "io": 4,
    "tbptt": 4,
    "distributed": 4,
    "cli": 5,  # the command line draws (render) and loads models (virtual)
    "__main__": 6,
    "": 6,  # vgraph/__init__.py re-exports everything
}
TOP = 4

# Imports between modules of the top ring, each with its reason. Anything else there is a
# dependency between peers that should go through the core instead.
PEER_IMPORTS = {
    ("io", "optim"): "a training state holds an optimiser's state (Optimizer.state_dict)",
    ("distributed", "optim"): "wraps an optimiser (DistributedOptimizer) and broadcasts its state",
    ("distributed", "io"): "rank 0 writes the training state (save_training_state)",
}


def _top(module: str) -> str:
    """The first component under ``vgraph`` ("" for the package itself)."""
    return module.split(".")[1] if "." in module else ""


def _imports() -> list[tuple[str, str, int]]:
    """(importing module, imported vgraph module, line) for every import in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        package = module if is_package else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    if node.module:
                        targets = [".".join([*base, node.module])]
                    else:  # from . import x, y
                        targets = [".".join([*base, a.name]) for a in node.names]
                elif node.module and node.module.split(".")[0] == "vgraph":
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "vgraph"]
            found.extend((module, t, node.lineno) for t in targets)
    return found


def test_every_module_has_a_layer():
    unknown = {_top(m) for m, _, _ in _imports()} | {_top(t) for _, t, _ in _imports()}
    unknown -= set(LAYERS) | {"__version__"}
    assert not unknown, f"modules without a layer in tests/test_layers.py: {sorted(unknown)}"


def _allowed(module: str, target: str) -> bool:
    """Whether ``module`` may import ``target``: same layer below the top ring, or a lower
    layer; in the top ring only the listed peer imports."""
    src, dst = _top(module), _top(target)
    if dst == "__version__" or src == dst:
        return True
    if LAYERS[dst] > LAYERS[src]:
        return False
    return not (LAYERS[src] == LAYERS[dst] == TOP and (src, dst) not in PEER_IMPORTS)


def test_no_import_goes_up_or_sideways():
    bad = [f"{m} (line {line}) imports {t}" for m, t, line in _imports() if not _allowed(m, t)]
    assert not bad, "imports against the layering of DESIGN.md §2:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("module", "target", "expected"),
    [("vgraph.ops", "vgraph.compute", False), ("vgraph.compute", "vgraph.ops", True),
     ("vgraph.nn", "vgraph.render", False), ("vgraph.io", "vgraph.optim", True),
     ("vgraph.virtual.unroll", "vgraph.render.scene", False), ("vgraph.tape", "vgraph.ops", True)],
)  # fmt: skip
def test_the_rule_itself(module, target, expected):
    """The checker tells down from up and sideways (so the test above can fail)."""
    assert _allowed(module, target) is expected
