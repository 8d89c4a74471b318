"""Untied parameter copies that only some ranks hold, under ``mpiexec -n 2``:
``python tests/mpi_scripts/untied.py``.

The model has two loops over sequences, each with an untied bias per step (``a@t``, ``b@t``).
Before the optimiser is made, rank 0 has built a 3-step ``xa`` and a 1-step ``xb``, rank 1 the
reverse: ``a@1``, ``a@2`` exist on rank 0 only (the root of the start broadcast), ``b@1``, ``b@2``
on rank 1 only. The ranks' graphs have different seeds, so every parameter starts with a different
value on each rank. Then one training step in which rank 0 builds ``a@3`` and rank 1 ``b@3``.

Every broadcast is recorded; rank 0 prints one line
``RESULT {"sent": {name: n}, "equal": ..., "expected": ...}``: ``sent[name]`` is the number of
broadcasts that carried the parameter's value (an array equal to it, anywhere in the payload)
while it was being given to the ranks, ``equal`` whether every rank ends with the same values, and
``expected`` whether a parameter root had took root's value, and one root lacked its owner's.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

import vgraph as vg
from vgraph import distributed as dist
from vgraph import optim

H = 3


class Recording(dist.MPICommunicator):
    """Keeps what every broadcast delivered."""

    def __init__(self) -> None:
        super().__init__(timeout=60.0)
        self.payloads: list[Any] = []

    def bcast(self, obj: Any, root: int = 0, what: str = "broadcast") -> Any:
        out = super().bcast(obj, root, what)
        self.payloads.append(out)
        return out


def arrays(payload: Any) -> list[np.ndarray]:
    """Every array anywhere in a (nested) payload."""
    found, stack = [], [payload]
    while stack:
        x = stack.pop()
        if isinstance(x, np.ndarray):
            found.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return found


def times_sent(payloads: list[Any], value: np.ndarray) -> int:
    return sum(
        a.shape == value.shape and a.dtype == value.dtype and np.array_equal(a, value)
        for p in payloads
        for a in arrays(p)
    )


def model(seed: int) -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    finals = []
    for name in ("a", "b"):
        xs = g.input(f"x{name}", (None, H))
        with g.loop(name=f"loop_{name}") as L:
            x = L.step(xs)
            h = L.carry(np.zeros(H), name="h")
            bias = g.parameter(name, (H,), share=False, init=vg.nn.normal(1.0))
            L.update(h, vg.tanh(x + h + bias))
        finals.append(vg.sum(L.final(h)))
    W = g.parameter("W", (H,), init=vg.nn.normal(1.0))
    return g, finals[0] + finals[1] + vg.sum(W * W)


def feed(ta: int, tb: int) -> dict[str, np.ndarray]:
    return {"xa": np.ones((ta, H)), "xb": np.ones((tb, H))}


def main() -> None:
    dist.init(timeout=60.0)  # the exception hook: a failure on one rank ends both
    comm = Recording()
    assert comm.size == 2, "run with mpiexec -n 2"
    g, loss = model(seed=comm.rank)
    g.build(feed(3, 1) if comm.rank == 0 else feed(1, 3), loss)
    before = {k: p.value.copy() for k, p in g.params.items()}
    everyone = comm.allgather(before, "the values before")
    comm.payloads.clear()

    opt = dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g, comm)
    start = {k: p.value.copy() for k, p in g.params.items()}
    sent = {k: times_sent(comm.payloads, v) for k, v in start.items()}
    # A parameter root (rank 0) holds is root's; one it lacks is its owner's (rank 1 here).
    expected = all(
        np.array_equal(v, (everyone[0] if k in everyone[0] else everyone[1])[k]) for k, v in start.items()
    )

    # One step in which each rank creates a copy the other lacks.
    comm.payloads.clear()
    g.build(feed(4, 1) if comm.rank == 0 else feed(1, 4), loss).backward(loss)
    new = "a@3" if comm.rank == 0 else "b@3"
    created = g.params[new].value.copy()  # before the step changes it
    opt.step()
    owned = comm.allgather({new: created}, "the new copies")
    for k, v in ((k, v) for part in owned for k, v in part.items()):
        sent[k] = times_sent(comm.payloads, v)

    final = comm.allgather({k: p.value for k, p in g.params.items()}, "the values after")
    equal = sorted(final[0]) == sorted(final[1]) and all(
        np.array_equal(final[0][k], final[1][k]) for k in final[0]
    )
    if comm.rank == 0:
        print("RESULT " + json.dumps({"sent": sent, "equal": equal, "expected": expected}), flush=True)


if __name__ == "__main__":
    main()
