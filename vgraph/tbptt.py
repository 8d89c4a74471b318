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

:class:`Progress` reports the progress of a training loop (this module's and any other): a tqdm
bar with rate and ETA when tqdm is installed and the output is a terminal or a notebook, plain
periodic lines otherwise (logs, CI).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from .modes import int_arg

__all__ = ["Progress", "TBPTTResult", "chunk_feeds", "chunks", "truncated_bptt"]

# ---------------------------------------------------------------------------- progress

_MODES = ("auto", "bar", "lines", "off")


def _in_notebook() -> bool:
    """Whether we run in a Jupyter kernel (where tqdm.auto shows a widget)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _tqdm() -> Any:
    """tqdm's text bar class, or ``None`` if tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _widget_bar(**options: Any) -> Any:
    """A tqdm notebook widget bar, or ``None`` (quietly) if ipywidgets is not installed or the
    widget cannot be made.

    Not ``tqdm.auto``: in a notebook without ipywidgets it warns on stderr before falling back.
    """
    try:
        importlib.import_module("ipywidgets")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # tqdm.notebook's own notices about its widgets
            notebook = importlib.import_module("tqdm.notebook")
            if getattr(notebook, "IProgress", None) is None:  # ipywidgets without the widgets tqdm needs
                return None
            # Made in two steps to keep hold of a bar that fails halfway (no frontend for the
            # widget): left as it is, it would print a traceback from its __del__ when collected.
            bar = notebook.tqdm.__new__(notebook.tqdm)
            try:
                bar.__init__(**options)
            except Exception:
                _tqdm().close(bar)  # the text bar's close: releases its place, draws nothing
                bar.disable = True  # and the widget's own close (from __del__) returns at once
                return None  # the text bar will do
            return bar
    except Exception:  # a missing or broken widget stack: the text bar will do
        return None


def _duration(seconds: float) -> str:
    h, rest = divmod(round(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt(metrics: Mapping[str, Any]) -> str:
    return "  ".join(
        f"{k} {v:.4g}" if isinstance(v, (float, np.floating)) else f"{k} {v}" for k, v in metrics.items()
    )


class Progress:
    """Progress of a loop of ``total`` steps: a tqdm bar, or plain periodic lines.

    * ``mode="bar"``: a tqdm bar with rate, elapsed time and ETA, and the latest metrics after
      it: a widget in Jupyter when ipywidgets is installed (and ``file`` is not given), else the
      text bar. Without tqdm installed it falls back to lines.
    * ``mode="lines"``: one line every ``every`` steps (and at the last), for logs and CI::

          train   40/600  loss 1.234  15.2 step/s  elapsed 00:02  ETA 00:36

    * ``mode="auto"`` (default): the bar if tqdm is installed and ``file`` is a terminal or we run
      in a notebook, else lines.
    * ``mode="off"``: nothing.

    Use it as a context manager (or call :meth:`close`)::

        with Progress(steps, desc="train") as progress:
            for step in range(steps):
                ...
                progress.update(loss=loss)                         # every step
                # at a report step, also keep a line in the output:
                progress.update(0, log=True, **{"held-out MSE": mse})

    Args:
        total: the number of steps (``None`` if unknown: no ETA).
        desc: a label in front of the bar or lines.
        mode: ``"auto"``, ``"bar"``, ``"lines"`` or ``"off"``.
        every: lines mode: print every this many steps (default: a tenth of ``total``, or 100).
        file: where to write (default ``sys.stderr`` for the bar, ``sys.stdout`` for lines).
        unit: the name of one step (``"step"``, ``"chunk"``, ``"batch"`` …).

    Raises:
        ValueError: an unknown ``mode``; a negative ``total`` or ``every < 1``
            (:class:`~vgraph.errors.ArgumentValueError`).
        ArgumentError: ``total``/``every`` not ints or ``None`` (a TypeError).
    """

    #: The help of the ``--progress`` option :meth:`add_option` adds.
    OPTION_HELP = (
        "a tqdm bar with rate and ETA (auto: in a terminal, when tqdm is installed), plain lines, or nothing"
    )

    @staticmethod
    def add_option(parser: argparse.ArgumentParser, help: str = OPTION_HELP) -> None:
        """Add ``--progress {auto,bar,lines,off}`` (default ``auto``) to a command-line ``parser``:
        its value is the ``mode`` to make a :class:`Progress` with (the examples' option).

        Args:
            parser: the parser to add the option to.
            help: its help text.
        """
        parser.add_argument("--progress", choices=_MODES, default="auto", help=help)

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        mode: str = "auto",
        every: int | None = None,
        file: IO[str] | None = None,
        unit: str = "step",
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"progress mode must be one of {', '.join(map(repr, _MODES))}, got {mode!r}")
        self.total = int_arg(total, "total", 0, optional=True)
        every = int_arg(every, "every", 1, optional=True)
        self.desc = desc
        self.unit = unit
        self.every = every if every is not None else max(1, (self.total or 1000) // 10)
        self.count = 0
        self.metrics: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._bar: Any = None
        tqdm = _tqdm() if mode in ("auto", "bar") else None
        notebook = tqdm is not None and _in_notebook()
        if mode == "auto" and tqdm is not None:
            out = file if file is not None else sys.stderr
            isatty = getattr(out, "isatty", None)
            if not (notebook or (callable(isatty) and isatty())):
                tqdm = None
        if tqdm is not None:
            self.mode = "bar"
            options = {
                "total": self.total,
                "desc": desc or None,
                "unit": unit,
                "file": file,
                "dynamic_ncols": True,
            }
            widget = _widget_bar(**options) if notebook and file is None else None
            self._bar = widget if widget is not None else tqdm(**options)
        else:
            self.mode = "off" if mode == "off" else "lines"
        self._file = file

    def line(self) -> str:
        """The current state as one line: count, metrics, rate, elapsed time, ETA."""
        elapsed = time.perf_counter() - self._start
        rate = self.count / elapsed if elapsed > 0 else 0.0
        parts = [self.desc] if self.desc else []
        width = len(str(self.total)) if self.total is not None else 0
        parts.append(f"{self.count:>{width}}/{self.total}" if self.total is not None else f"{self.count}")
        if self.metrics:
            parts.append(_fmt(self.metrics))
        parts.append(f"{rate:.3g} {self.unit}/s")
        parts.append(f"elapsed {_duration(elapsed)}")
        if self.total is not None and rate > 0:
            parts.append(f"ETA {_duration(max(0, self.total - self.count) / rate)}")
        return "  ".join(parts)

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._file)
        else:
            print(text, file=self._file if self._file is not None else sys.stdout, flush=True)

    def update(self, n: int = 1, log: bool = False, **metrics: Any) -> None:
        """Advance ``n`` steps and record ``metrics`` (shown after the count).

        Args:
            n: steps done since the last call (0 to only record metrics).
            log: also keep a line with the current state in the output now (above the bar).
            **metrics: name -> value, e.g. ``loss=0.25``; they stay shown until replaced.
        """
        self.count += n
        self.metrics.update(metrics)
        if self.mode == "off":
            return
        if self._bar is not None:
            if metrics:
                self._bar.set_postfix_str(_fmt(self.metrics), refresh=False)
            self._bar.update(n)
            if log:
                self._print(self.line())
            return
        due = n > 0 and (self.count % self.every == 0 or self.count == self.total)
        if log or due:
            self._print(self.line())

    def write(self, text: str) -> None:
        """Print ``text`` without breaking the bar (nothing in ``"off"`` mode)."""
        if self.mode != "off":
            self._print(text)

    def close(self) -> None:
        """Finish the bar (lines mode: nothing to do)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _progress(progress: Any, total: int | None, desc: str, unit: str) -> Progress | None:
    """``truncated_bptt``'s ``progress`` argument as a :class:`Progress` (``None``: off)."""
    if progress is None or progress is False:
        return None
    if isinstance(progress, Progress):
        return progress
    if progress is True:
        progress = "auto"
    if not isinstance(progress, str):
        raise TypeError(
            f"progress must be a bool, 'auto', 'bar', 'lines', 'off' or a Progress, got {type(progress).__name__}"
        )
    return Progress(total, desc=desc, mode=progress, unit=unit)


def _time_axis(axis: Any, shape: tuple[int, ...], what: str) -> int:
    """``axis`` checked as the time axis of an array of ``shape`` (``what`` names the array).

    Raises:
        ArgumentError: ``axis`` is not an int. ValueError: a scalar, or an axis it does not have.
    """
    index = int_arg(axis, "axis")
    if not shape:
        raise ValueError(f"{what} must be a sequence (an array with a time axis), got a scalar")
    if not -len(shape) <= index < len(shape):
        raise ValueError(f"axis {index} is not an axis of {what}, of shape {shape}")
    return index


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
        TypeError: ``k`` or ``axis`` is not an int.
        ValueError: ``k < 1``, a scalar ``xs`` or an ``axis`` it does not have.
    """
    k = int_arg(k, "chunk length k", 1)
    arr = np.asarray(xs)
    axis = _time_axis(axis, arr.shape, "xs")
    n = arr.shape[axis]
    for start in range(0, n, int(k)):
        stop = min(start + int(k), n)
        if drop_last and stop - start < k:
            return
        index = [slice(None)] * arr.ndim
        index[axis] = slice(start, stop)
        yield arr[tuple(index)]


class ChunkFeeds:
    """The per-chunk feeds of :func:`chunk_feeds`: an iterator that also knows its length (so a
    progress bar can show an ETA)."""

    def __init__(
        self, feed: Mapping[str, Any], k: int, names: list[str], axis: int, drop_last: bool, n: int
    ) -> None:
        static = {name: v for name, v in feed.items() if name not in names}
        parts = [chunks(feed[name], k, axis, drop_last) for name in names]
        self._it = ({**static, **dict(zip(names, pieces))} for pieces in zip(*parts))
        self._len = (n // k if drop_last else -(-n // k)) if names else 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._it)

    def __len__(self) -> int:
        """The number of chunks (as created; it does not shrink while iterating)."""
        return self._len


def chunk_feeds(
    feed: Mapping[str, Any], k: int, sequences: Iterable[str], axis: int = 0, drop_last: bool = False
) -> ChunkFeeds:
    """Split a feed into per-chunk feeds: the inputs named in ``sequences`` are cut into chunks of
    ``k`` steps (all must have the same length), the other inputs are passed to every chunk.

    Returns:
        An iterator over the chunk feeds, with ``len()``.

    Raises:
        TypeError: ``feed`` is not a mapping, ``sequences`` a string, ``k`` or ``axis`` not an int.
        ValueError: sequences of different lengths, an unknown name, ``k < 1``, or a sequence
            that is a scalar or lacks the axis ``axis``.
    """
    if not isinstance(feed, Mapping):
        raise TypeError(f"feed must be a mapping input name -> value, got {type(feed).__name__}")
    k = int_arg(k, "chunk length k", 1)
    if isinstance(sequences, str):
        raise TypeError(
            f"sequences must be a list of input names, got the string {sequences!r} (use [{sequences!r}])"
        )
    names = list(sequences)
    unknown = [n for n in names if n not in feed]
    if unknown:
        raise ValueError(f"sequence input(s) {unknown} not in the feed")
    shapes = {n: np.shape(feed[n]) for n in names}
    lengths = {n: shape[_time_axis(axis, shape, f"sequence input {n!r}")] for n, shape in shapes.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sequences to chunk have different lengths: {lengths}")
    n = next(iter(lengths.values())) if lengths else 0
    return ChunkFeeds(feed, int(k), names, axis, drop_last, n)


@dataclass
class TBPTTResult:
    """What :func:`truncated_bptt` did.

    Attributes:
        losses: the loss of each chunk this call ran, in order.
        state: the recurrent state after the latest chunk, by input name (arrays): the state
            inputs of chunk :attr:`next_chunk`, to continue from.
        start: the index of the first chunk this call ran (its ``start`` argument).
    """

    losses: list[float] = field(default_factory=list)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    start: int = 0

    @property
    def next_chunk(self) -> int:
        """The index of the chunk to run next: pass it as ``start=`` (and :attr:`state` as
        ``initial=``) to resume from here, e.g. after loading a mid-epoch checkpoint."""
        return self.start + len(self.losses)


def truncated_bptt(
    graph: Any,
    feeds: Iterable[Mapping[str, Any]],
    loss: Any,
    state: Mapping[str, Any],
    initial: Mapping[str, Any],
    optimizer: Any = None,
    callback: Callable[[int, Any, float], None] | None = None,
    progress: bool | str | Progress = False,
    *,
    start: int = 0,
    after_chunk: Callable[[int, TBPTTResult], None] | None = None,
) -> TBPTTResult:
    """Run a model chunk by chunk, carrying its recurrent state across chunks without gradient.

    For each chunk feed: build ``graph`` with the chunk's inputs plus the current state inputs
    and read the state nodes' values as plain arrays — the next chunk's state inputs; in
    training mode zero every parameter's gradient, backpropagate ``loss`` (BPTT within the
    chunk), call ``callback`` and ``optimizer.step()``; then call ``after_chunk``. In evaluation
    mode (``graph.eval()``) nothing is backpropagated: it evaluates a long sequence statefully,
    chunk by chunk.

    To resume in the middle of a sequence (from a checkpoint saved by ``after_chunk``), pass the
    same ``feeds`` with ``start`` = the saved :attr:`TBPTTResult.next_chunk` and ``initial`` = the
    saved :attr:`TBPTTResult.state`: the chunks before ``start`` are skipped, not built.

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
            the optimiser step, while the gradients are complete and not yet applied (e.g. to
            clip gradients or to log them).
        progress: report progress per chunk with each chunk's loss: ``True`` / ``"auto"`` (a tqdm
            bar with rate and ETA in a terminal or notebook when tqdm is installed, else plain
            lines), ``"bar"``, ``"lines"``, or a :class:`Progress` you made (left open). The
            total is ``len(feeds) - start`` when known (:func:`chunk_feeds` knows it).
        start: the index of the first chunk to run (``initial`` is then the state carried into
            it); the feeds before it are skipped. Chunk indices stay those of ``feeds``.
        after_chunk: ``after_chunk(chunk_index, result)`` at the end of each chunk, after the
            optimiser step, with the result so far (this call's losses, the state carried into
            chunk ``result.next_chunk``): the place to save a mid-epoch checkpoint
            (:func:`vgraph.io.save_training_state` with the state and position as ``extras``).

    Returns:
        A :class:`TBPTTResult` with every chunk's loss and the final state.

    Raises:
        ValueError: ``state`` and ``initial`` name different inputs; a bad ``progress`` mode;
            a negative ``start``, or one past the end of ``feeds`` (nothing was run then).
        TypeError: ``graph`` not a VirtualGraph, ``optimizer`` without ``step()``,
            ``state``/``initial`` not mappings, ``callback``/``after_chunk`` not callable,
            ``progress`` of another type, ``start`` not an int.
        Whatever a build raises (FeedError, BuildError …).
    """
    from .virtual import VirtualGraph

    if not isinstance(graph, VirtualGraph):
        raise TypeError(f"graph must be a VirtualGraph, got {type(graph).__name__}")
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(
            f"optimizer must have a step() method (a vgraph.optim optimiser), got {type(optimizer).__name__}"
        )
    for name, m in (("state", state), ("initial", initial)):
        if not isinstance(m, Mapping):
            raise TypeError(f"{name} must be a mapping input name -> ..., got {type(m).__name__}")
    for name, f in (("callback", callback), ("after_chunk", after_chunk)):
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be callable, got {type(f).__name__}")
    if set(state) != set(initial):
        raise ValueError(f"state names {sorted(state)} and initial names {sorted(initial)} differ")
    start = int_arg(start, "start", 0)
    total = len(feeds) if isinstance(feeds, Sized) else None
    if total is not None and start > total:
        raise ValueError(f"start={start} is past the end of feeds ({total} chunks); nothing was run")
    if total is not None:
        total -= start
    own = not isinstance(progress, Progress)
    bar = _progress(progress, total, "TBPTT", "chunk")
    try:
        return _run_chunks(graph, feeds, loss, state, initial, optimizer, callback, bar, start, after_chunk)
    finally:
        if bar is not None and own:
            bar.close()


def _run_chunks(
    graph: Any,
    feeds: Iterable[Mapping[str, Any]],
    loss: Any,
    state: Mapping[str, Any],
    initial: Mapping[str, Any],
    optimizer: Any,
    callback: Callable[[int, Any, float], None] | None,
    bar: Progress | None,
    start: int,
    after_chunk: Callable[[int, TBPTTResult], None] | None,
) -> TBPTTResult:
    values = {name: np.asarray(v) for name, v in initial.items()}
    result = TBPTTResult(state=values, start=start)
    names = list(state)
    outs = [loss, *(state[n] for n in names)]
    seen = 0
    for i, feed in enumerate(feeds):
        seen = i + 1
        if i < start:
            continue
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
        if bar is not None:
            bar.update(loss=value)
        if after_chunk is not None:
            after_chunk(i, result)
    if seen < start:
        raise ValueError(f"start={start} is past the end of feeds ({seen} chunks); nothing was run")
    return result
