"""Truncated backpropagation through time (TBPTT): train on a long sequence in chunks.

A sequence of T steps is cut into chunks of k steps. Each chunk is its own build of the model,
whose initial recurrent state is a graph *input* fed with the previous chunk's final state as a
plain numpy array. A plain array carries no graph, so the gradient stops at the chunk boundary —
this is what ``detach`` does in other frameworks — while the forward state flows on unbroken::

    h = np.zeros((B, H))
    for x_chunk, y_chunk in zip(chunks(xs, k), chunks(ys, k)):
        cg = g.build({"x": x_chunk, "y": y_chunk, "h0": h}, [loss, h_final])
        opt.zero_grad()
        cg.backward(loss)          # BPTT over these k steps only
        opt.step()
        h = np.array(cg.node(h_final).value)   # the state crosses builds as a plain array

The gradient of one chunk is exactly full BPTT of that chunk's loss over its k steps, starting
from the carried-in state as a constant. :func:`truncated_bptt` runs that loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["TBPTTResult", "chunk_feeds", "chunks", "truncated_bptt"]


def chunks(xs: Any, k: int, axis: int = 0, drop_last: bool = False) -> Iterator[np.ndarray]:
    """Consecutive slices of ``k`` steps of ``xs`` along ``axis`` (time; the leading axis by default).

    Args:
        xs: an array-like sequence.
        k: the chunk length (>= 1).
        axis: the time axis.
        drop_last: skip a final chunk shorter than ``k`` (it would build a graph with fewer
            iterations; keeping it is fine, but it is unrolled separately).

    Yields:
        Views of ``xs``, ``ceil(T / k)`` of them (``floor(T / k)`` with ``drop_last``).

    Raises:
        ValueError: ``k < 1``.
    """
    if int(k) != k or k < 1:
        raise ValueError(f"chunk length k must be a positive int, got {k}")
    arr = np.asarray(xs)
    n = arr.shape[axis]
    for start in range(0, n, int(k)):
        stop = min(start + int(k), n)
        if drop_last and stop - start < k:
            return
        index = [slice(None)] * arr.ndim
        index[axis] = slice(start, stop)
        yield arr[tuple(index)]


def chunk_feeds(
    feed: Mapping[str, Any], k: int, sequences: Iterable[str], axis: int = 0, drop_last: bool = False
) -> Iterator[dict[str, Any]]:
    """Split a feed into per-chunk feeds: the inputs named in ``sequences`` are cut into chunks of
    ``k`` steps (all must have the same length), the other inputs are passed to every chunk.

    Raises:
        ValueError: sequences of different lengths, an unknown name, or ``k < 1``.
    """
    names = list(sequences)
    unknown = [n for n in names if n not in feed]
    if unknown:
        raise ValueError(f"sequence input(s) {unknown} not in the feed")
    lengths = {n: np.shape(feed[n])[axis] for n in names}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sequences to chunk have different lengths: {lengths}")
    static = {n: v for n, v in feed.items() if n not in names}
    parts = [chunks(feed[n], k, axis, drop_last) for n in names]
    for pieces in zip(*parts):
        yield {**static, **dict(zip(names, pieces))}


@dataclass
class TBPTTResult:
    """What :func:`truncated_bptt` did.

    Attributes:
        losses: the loss of each chunk, in order.
        state: the final recurrent state, by input name (arrays), to continue from.
    """

    losses: list[float] = field(default_factory=list)
    state: dict[str, np.ndarray] = field(default_factory=dict)


def truncated_bptt(
    graph: Any,
    feeds: Iterable[Mapping[str, Any]],
    loss: Any,
    state: Mapping[str, Any],
    initial: Mapping[str, Any],
    optimizer: Any = None,
    callback: Callable[[int, Any, float], None] | None = None,
) -> TBPTTResult:
    """Run a model chunk by chunk, carrying its recurrent state across chunks without gradient.

    For each chunk feed: build ``graph`` with the chunk's inputs plus the current state inputs;
    in training mode zero every parameter's gradient, backpropagate ``loss`` (BPTT within the
    chunk), call ``callback`` and ``optimizer.step()``; then read the state nodes' values as plain
    arrays — the next chunk's state inputs. In evaluation mode (``graph.eval()``) nothing is
    backpropagated: it evaluates a long sequence statefully, chunk by chunk.

    Args:
        graph: the :class:`~vgraph.virtual.VirtualGraph`.
        feeds: one feed per chunk (e.g. from :func:`chunk_feeds`), without the state inputs.
        loss: the scalar virtual node to minimise.
        state: state input name -> the top-level virtual node whose value feeds it next chunk,
            e.g. ``{"h0": loop.final(h), "c0": loop.final(c)}``.
        initial: state input name -> the initial value, e.g. ``{"h0": np.zeros((B, H))}``.
        optimizer: updates parameters after each chunk (``None``: gradients are left in ``.grad``
            of each chunk for ``callback`` to use, and cleared before the next chunk).
        callback: ``callback(chunk_index, compute_graph, loss_value)``, after backward and before
            the optimiser step (e.g. to clip gradients or to log).

    Returns:
        A :class:`TBPTTResult` with every chunk's loss and the final state.

    Raises:
        ValueError: ``state`` and ``initial`` name different inputs.
        Whatever a build raises (FeedError, BuildError …).
    """
    if set(state) != set(initial):
        raise ValueError(f"state names {sorted(state)} and initial names {sorted(initial)} differ")
    values = {name: np.asarray(v) for name, v in initial.items()}
    result = TBPTTResult(state=values)
    names = list(state)
    outs = [loss, *(state[n] for n in names)]
    for i, feed in enumerate(feeds):
        cg = graph.build({**feed, **values}, outs)
        loss_node = cg.outputs[0]
        # The state as computed in this chunk's forward (before any update): plain arrays.
        values = {n: np.array(node.value) for n, node in zip(names, cg.outputs[1:])}
        if graph.training:
            graph.params.zero_grad()
            value = cg.backward(loss_node)
            if callback is not None:
                callback(i, cg, value)
            if optimizer is not None:
                optimizer.step()
        else:
            value = float(np.reshape(loss_node.value, ()))
            if callback is not None:
                callback(i, cg, value)
        result.losses.append(value)
        result.state = values
    return result
