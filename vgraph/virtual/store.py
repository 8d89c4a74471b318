"""The parameter store: every parameter of a VirtualGraph by name, shared by all its builds."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compute import ComputeNode
from .nodes import _declared_name

if TYPE_CHECKING:
    from .nodes import VirtualNode

# ---------------------------------------------------------------------------- parameter store


class ParameterStore(Mapping[str, ComputeNode]):
    """Every parameter of a VirtualGraph by name, as leaf compute nodes shared by all builds.

    A parameter declared outside loops, or with ``share=True``, is one entry (its name). An untied
    parameter declared in a loop body has one entry per iteration path, ``"name@2"`` or
    ``"name@1.3"``, created (and initialised) the first time a build reaches that iteration.
    Optimisers update the nodes' values in place; compute graphs see the new values.
    :meth:`set_value` on an untied copy no build has reached yet creates it first.
    """

    def __init__(
        self,
        create: Callable[[str], ComputeNode] | None = None,
        spec: Callable[[str], tuple[tuple[int, ...], np.dtype] | None] | None = None,
    ) -> None:
        self._nodes: dict[str, ComputeNode] = {}
        self._create = create  # makes an untied copy by name (its VirtualGraph's declarations)
        self._spec = spec  # the declared (shape, dtype) of a name, without creating anything

    def __getitem__(self, name: str) -> ComputeNode:
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r}; known: {', '.join(self._nodes) or 'none'}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __repr__(self) -> str:
        values = sum(int(np.size(p._value)) for p in self._nodes.values())
        shown = ", ".join(f"{k} {p.shape}" for k, p in list(self._nodes.items())[:8])
        more = f", … {len(self._nodes) - 8} more" if len(self._nodes) > 8 else ""
        return f"ParameterStore({len(self._nodes)} parameters, {values} values: {shown}{more})"

    def parameters(self) -> list[ComputeNode]:
        """The parameter nodes, in creation order (what optimisers take)."""
        return list(self._nodes.values())

    def declared(self, name: str) -> tuple[tuple[int, ...], np.dtype] | None:
        """The shape and dtype of parameter ``name``: an entry's, or, for an untied copy no build
        has created yet (``"W@7"``), the ones its declaration gives it. Creates nothing.

        Returns:
            ``(shape, dtype)``, or ``None`` if the graph declares no parameter of that name.
        """
        if not isinstance(name, str):
            return None
        node = self._nodes.get(name)
        if node is not None:
            return node.shape, node.dtype
        return None if self._spec is None else self._spec(name)

    def value(self, name: str) -> np.ndarray:
        """A copy of a parameter's value."""
        return np.array(self[name].value)

    def set_value(self, name: str, value: Any) -> None:
        """Set one parameter's value (same shape; cast to its dtype).

        An untied copy no build has created yet (``"W@7"``) is created first, so a model can be
        set up completely before its first build.

        Raises:
            KeyError: a name that is no parameter or untied copy of the graph. ShapeError: a
                different shape (nothing is created then).
        """
        node = self._nodes.get(name)
        if node is None and self._create is not None and "@" in name:
            arr = np.array(value)
            node = self._create(name)
            try:
                node.set_value(arr)
            except Exception:
                del self._nodes[name]
                raise
            return
        self[name].set_value(np.array(value))

    def zero_grad(self) -> None:
        """Clear every parameter's ``.grad``."""
        for p in self._nodes.values():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of all values by name (what a checkpoint holds)."""
        return {k: np.array(p.value) for k, p in self._nodes.items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Set the values of existing entries from ``state`` (name -> array), checking all of it first.

        The store holds no declarations, so it cannot create an untied copy (``"W@7"``) that no
        build has made yet: :meth:`VirtualGraph.load_state_dict` (or :func:`vgraph.io.load`) can.

        Args:
            state: name -> array, e.g. from :meth:`state_dict`.
            strict: every entry of the store must be in ``state``.

        Raises:
            TypeError: ``state`` is not a mapping, or holds a non-numeric array. KeyError: a name
            not in the store, or (strict) a missing one. ShapeError: a shape differing from the
            entry's. Nothing is changed when any of them is raised.
        """
        from ..errors import ShapeError

        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping name -> array, got {type(state).__name__}")
        staged: dict[str, np.ndarray] = {}
        for name, value in state.items():
            node = self._nodes.get(name)
            if node is None:
                raise KeyError(
                    f"no parameter {name!r} in the store (an untied copy no build has created yet "
                    "is created by VirtualGraph.load_state_dict)"
                )
            arr = np.asarray(value)
            if arr.dtype.kind not in "fiu":
                raise TypeError(f"parameter {name!r}: cannot load dtype {arr.dtype}")
            if arr.shape != node.shape:
                raise ShapeError(f"parameter {name!r}: state shape {arr.shape}, parameter shape {node.shape}")
            staged[name] = arr
        missing = [k for k in self._nodes if k not in staged]
        if strict and missing:
            raise KeyError(f"state lacks parameters {', '.join(missing)}")
        for name, arr in staged.items():
            self._nodes[name].set_value(arr)

    def _add(self, name: str, node: ComputeNode) -> None:
        self._nodes[name] = node


def _store_name(decl: VirtualNode, idx: tuple[int, ...]) -> str:
    """A parameter's name in the store: its declared name, plus ``@idx`` for an untied copy."""
    name = _declared_name(decl)
    return name if decl.attrs["share"] else f"{name}@{'.'.join(map(str, idx))}"


def _is_iteration_path(text: str, depth: int) -> bool:
    """Whether ``text`` is an iteration path as untied parameter names print it (``"3"``, ``"1.2"``)
    with ``depth`` levels."""
    parts = text.split(".")
    return len(parts) == depth and all(p.isdigit() and str(int(p)) == p for p in parts)
