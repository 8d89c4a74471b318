"""Threads: grad mode and anomaly mode belong to the thread that sets them, and builds of one
VirtualGraph from several threads give exactly the values of single-threaded builds.

The mode tests interleave two threads deliberately (events waited on from a loop condition, which
runs in the middle of a build), so that one thread's ``no_grad`` / ``detect_anomaly`` window opens
and closes while the other thread is unrolling. Expected values come from the same builds run in
one thread, compared exactly (float64).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import vgraph as vg

WAIT = 10.0  # seconds any event may take before the test fails instead of hanging


def rnn(cond: Callable[[int, Any], bool] | None = None, seed: int = 3) -> tuple[vg.VirtualGraph, Any]:
    """A tanh RNN over ``xs`` with a squared-sum loss; ``cond`` (if given) runs before each step."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    xs = g.input("xs", (None, 2, 3))
    W = g.parameter("W", (3, 4))
    U = g.parameter("U", (4, 4))
    with g.loop(while_=cond) as L:
        h = L.carry(np.zeros((2, 4)), name="h")
        x = L.step(xs)
        L.update(h, vg.tanh(x @ W + h @ U))
    return g, vg.sum(L.final(h) ** 2)


def losses_and_grads(g: vg.VirtualGraph, loss: Any, xs: np.ndarray, cache: bool = True) -> Any:
    """One build's loss and its gradients for W and U, returned (``grad``: no ``.grad`` touched)."""
    cg = g.build({"xs": xs}, loss, cache=cache)
    out = cg.outputs[0]
    grads = cg.grad(out, [g.params["W"], g.params["U"]])
    return float(out.value), [np.array(x) for x in grads]


def assert_same(got: Any, want: Any) -> None:
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)


def window_at(
    first: int,
    last: int,
    mid: threading.Event,
    opened: threading.Event,
    progressed: threading.Event,
    closed: threading.Event,
) -> Callable[[int, Any], bool]:
    """A loop condition for the building thread: before step ``first`` it signals ``mid`` and waits
    until the other thread has ``opened`` its window; before step ``last`` it signals
    ``progressed`` and waits until the window is ``closed``. So steps ``first`` to ``last - 1``
    are built while the other thread is inside its window. The loop itself runs to the end of its
    sequence."""

    def cond(t: int, state: Any) -> bool:
        if t == first and not mid.is_set():
            mid.set()
            wait(opened)
        if t == last and not progressed.is_set():
            progressed.set()
            wait(closed)
        return True

    return cond


def wait(event: threading.Event) -> None:
    assert event.wait(WAIT), "the other thread did not get there"


class Worker(threading.Thread):
    """A thread that keeps its target's result or exception for the test to check."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = target
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:
            self.error = e

    def outcome(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


@contextmanager
def frequent_switches() -> Iterator[None]:
    """Let threads take turns every microsecond, so that interleavings are frequent."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


# ---------------------------------------------------------------------------- modes per thread


def test_no_grad_in_one_thread_changes_nothing_for_a_build_in_another():
    """Thread 1's no_grad window opens after thread 2 built steps 0-2 and closes before it builds
    step 6: thread 2's gradients are exactly the single-threaded ones (not truncated at the
    window), and thread 1 built without gradients inside its window."""
    xs = np.random.default_rng(0).normal(size=(9, 2, 3))
    g_ref, loss_ref = rnn()
    want = losses_and_grads(g_ref, loss_ref, xs, cache=False)

    mid, opened, progressed, closed = (threading.Event() for _ in range(4))
    g, loss = rnn(window_at(3, 6, mid, opened, progressed, closed))
    builder = Worker(lambda: losses_and_grads(g, loss, xs, cache=False))

    def window() -> Any:
        wait(mid)
        with vg.no_grad():
            opened.set()
            other, other_loss = rnn(seed=5)  # another graph: its own build, inside the window
            cg = other.build({"xs": xs}, other_loss, cache=False)
            inside = (vg.is_grad_enabled(), cg.outputs[0].requires_grad)
            wait(progressed)
        closed.set()
        return inside

    opener = Worker(window)
    builder.start()
    opener.start()
    assert opener.outcome() == (False, False)
    assert_same(builder.outcome(), want)


def test_no_grad_windows_of_two_threads_restore_each_thread_s_own_mode():
    """Thread 1 leaves its no_grad while thread 2 is still inside its own: thread 2 stays without
    gradients until it leaves (a process-wide mode would be switched back on under it)."""
    inside_1, inside_2, left_1 = (threading.Event() for _ in range(3))

    def first() -> bool:
        with vg.no_grad():
            inside_1.set()
            wait(inside_2)
        left_1.set()
        return vg.is_grad_enabled()

    def second() -> tuple[bool, bool]:
        wait(inside_1)
        with vg.no_grad():
            inside_2.set()
            wait(left_1)
            during = vg.is_grad_enabled()
        return during, vg.is_grad_enabled()

    a, b = Worker(first), Worker(second)
    a.start()
    b.start()
    assert a.outcome() is True
    assert b.outcome() == (False, True)


def test_detect_anomaly_in_one_thread_does_not_check_a_build_in_another():
    """Thread 1 turns anomaly detection on while thread 2 builds through a NaN (log of a negative
    value at step 4): thread 2, which did not ask, gets its NaN loss as a single-threaded build
    does, and thread 1's own NaN inside its window is reported."""
    xs = np.random.default_rng(1).normal(size=(8, 2, 3))

    def log_rnn(cond: Callable[[int, Any], bool] | None = None) -> tuple[vg.VirtualGraph, Any]:
        g = vg.VirtualGraph(dtype=np.float64, seed=3)
        seq = g.input("xs", (None, 2, 3))
        W = g.parameter("W", (3, 4))
        with g.loop(while_=cond) as L:
            h = L.carry(np.zeros((2, 4)), name="h")
            x = L.step(seq)
            L.update(h, h + vg.log(x @ W))  # NaN wherever x @ W < 0
        return g, vg.sum(L.final(h))

    with np.errstate(invalid="ignore"):
        g_ref, loss_ref = log_rnn()
        want = float(g_ref.build({"xs": xs}, loss_ref, cache=False).outputs[0].value)
    assert np.isnan(want)

    mid, opened, progressed, closed = (threading.Event() for _ in range(4))

    g, loss = log_rnn(window_at(2, 6, mid, opened, progressed, closed))

    def build() -> float:
        with np.errstate(invalid="ignore"):
            return float(g.build({"xs": xs}, loss, cache=False).outputs[0].value)

    def window() -> tuple[bool, type[BaseException] | None]:
        wait(mid)
        with vg.detect_anomaly():
            opened.set()
            other, other_loss = log_rnn()  # another graph, built inside the window: checked
            try:
                other.build({"xs": xs}, other_loss, cache=False)
                raised = None
            except vg.NonFiniteError as e:
                raised = type(e)
            on = vg.is_anomaly_enabled()
            wait(progressed)
        closed.set()
        return on, raised

    builder, opener = Worker(build), Worker(window)
    builder.start()
    opener.start()
    assert opener.outcome() == (True, vg.NonFiniteError)
    got = builder.outcome()
    assert np.isnan(got)


def test_a_new_thread_starts_with_gradients_on_and_anomaly_detection_off():
    """As in PyTorch: a thread started inside no_grad() / detect_anomaly() does not inherit them."""
    with vg.no_grad(), vg.detect_anomaly():
        child = Worker(lambda: (vg.is_grad_enabled(), vg.is_anomaly_enabled()))
        child.start()
        assert child.outcome() == (True, False)
        assert not vg.is_grad_enabled() and vg.is_anomaly_enabled()


def test_the_modes_are_exported_from_vgraph_and_from_compute():
    import vgraph.compute
    import vgraph.modes

    for name in ("no_grad", "is_grad_enabled", "detect_anomaly", "is_anomaly_enabled"):
        assert getattr(vg, name) is getattr(vgraph.modes, name) is getattr(vgraph.compute, name)


# ---------------------------------------------------------------------------- builds from threads


@pytest.mark.parametrize("cache", [True, False])
def test_concurrent_builds_of_one_graph_give_the_single_threaded_values(cache):
    """Two threads build one graph for many inputs of a few lengths and take gradients, each
    checking its loss and gradients against single-threaded builds: every value exact, no error.
    (Without per-thread caches, a build re-ran the graph another thread was still using; without
    one sweep at a time, two sweeps staged the shared parameters' gradients in the same place.)"""
    g, loss = rnn()
    rng = np.random.default_rng(0)
    feeds = [rng.normal(size=(int(rng.integers(3, 7)), 2, 3)) for _ in range(30)]
    want = [losses_and_grads(g, loss, xs, cache=False) for xs in feeds]
    wrong: list[int] = []

    def work(order: list[int]) -> int:
        done = 0
        for _ in range(10):
            for i in order:
                got = losses_and_grads(g, loss, feeds[i], cache)
                if got[0] != want[i][0] or any(not np.array_equal(a, b) for a, b in zip(got[1], want[i][1])):
                    wrong.append(i)
                done += 1
        return done

    with frequent_switches():
        workers = [Worker(lambda o=o: work(o)) for o in (list(range(30)), list(range(29, -1, -1)))]
        for w in workers:
            w.start()
        counts = [w.outcome() for w in workers]
    assert counts == [300, 300] and not wrong


def test_a_graph_returned_to_one_thread_stays_valid_while_another_builds_its_structure():
    """The cache is per thread: thread B's builds of the structure that thread A's graph has
    (cached) neither re-use A's nodes nor supersede A's graph."""
    g, loss = rnn()
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(5, 2, 3)), rng.normal(size=(5, 2, 3))
    want_a = losses_and_grads(g, loss, a, cache=False)
    g.build({"xs": a}, loss)
    cg = g.build({"xs": a}, loss)  # A's structure seen twice: cached (and re-run from now on)
    node = cg.node("Tanh:1@3")
    other = Worker(lambda: [losses_and_grads(g, loss, b) for _ in range(3)])
    other.start()
    got_b = other.outcome()
    assert_same(got_b[-1], losses_and_grads(g, loss, b, cache=False))
    out = cg.outputs[0]
    assert cg.node("Tanh:1@3") is node and float(out.value) == want_a[0]
    grads = cg.grad(out, [g.params["W"], g.params["U"]])
    assert_same((float(out.value), grads), want_a)
    assert g.build({"xs": b}, loss).node("Tanh:1@3") is node  # this thread's own cache as before


def test_a_thread_s_cached_graphs_are_freed_when_the_thread_ends():
    import gc
    import weakref

    g, loss = rnn()
    xs = np.random.default_rng(5).normal(size=(4, 2, 3))

    def build_twice() -> Any:
        g.build({"xs": xs}, loss)
        ref = weakref.ref(g.build({"xs": xs}, loss))  # seen before: kept by this thread's cache
        g.build({"xs": xs}, loss, cache=False)  # (not g.latest_build any more)
        gc.collect()
        assert ref() is not None
        return ref

    worker = Worker(build_twice)
    worker.start()
    ref = worker.outcome()
    g.build({"xs": xs}, loss, cache=False)  # g.latest_build no longer the thread's graph
    del worker
    gc.collect()
    assert ref() is None


def test_builds_of_one_graph_run_one_at_a_time():
    """A build started while another thread's build of the same graph is in progress waits for
    it (builds share the parameter store and the build counter); both give exact values."""
    xs = np.random.default_rng(3).normal(size=(6, 2, 3))
    reached, release = threading.Event(), threading.Event()
    steps: list[threading.Thread] = []  # which thread ran each loop step, in order

    def cond(t: int, state: Any) -> bool:
        steps.append(threading.current_thread())
        if t == 2 and threading.current_thread() is first and not reached.is_set():
            reached.set()
            wait(release)
        return True

    g, loss = rnn(cond)
    g_ref, loss_ref = rnn()
    want = losses_and_grads(g_ref, loss_ref, xs, cache=False)
    first = Worker(lambda: losses_and_grads(g, loss, xs, cache=False))
    second = Worker(lambda: losses_and_grads(g, loss, xs, cache=False))
    first.start()
    wait(reached)
    second.start()
    second.join(0.3)  # time for the second build to run steps, were it not waiting
    release.set()
    assert_same(first.outcome(), want)
    assert_same(second.outcome(), want)
    ran = [t is first for t in steps]
    assert ran == sorted(ran, reverse=True)  # every step of the first build before any of the second


def test_untied_copies_first_reached_by_two_threads_at_once_are_created_once():
    """Two threads' first builds reach the untied copies W@0... at the same time: each copy is
    created once, and both graphs use the store's copy (without one build at a time, a thread's
    graph could keep a copy the store did not take: trained by nothing, saved by nothing)."""
    orphans = 0
    with frequent_switches():
        for _ in range(30):
            g = vg.VirtualGraph(dtype=np.float64, seed=1)
            xs = g.input("xs", (None, 2, 3))
            with g.loop() as L:
                h = L.carry(np.zeros((2, 3)), name="h")
                W = g.parameter("W", (3, 3), share=False)
                L.update(h, vg.tanh(L.step(xs) @ W + h))
            loss = vg.sum(L.final(h))
            workers = [
                Worker(lambda T=T, g=g, loss=loss: g.build({"xs": np.ones((T, 2, 3))}, loss)) for T in (8, 9)
            ]
            for w in workers:
                w.start()
            graphs = [w.outcome() for w in workers]
            store = {id(p) for p in g.params.values()}
            assert len(store) == 9
            orphans += sum(id(p) not in store for cg in graphs for p in cg.parameters())
    assert orphans == 0


def test_backward_from_two_threads_accumulates_into_the_shared_parameters():
    """Parameters are shared by every build, in every thread (as a module's parameters are in
    PyTorch): concurrent backward calls add both threads' gradients into the same ``.grad``."""
    g, loss = rnn()
    rng = np.random.default_rng(4)
    feeds = [rng.normal(size=(4, 2, 3)) for _ in range(2)]
    each = [losses_and_grads(g, loss, xs, cache=False)[1] for xs in feeds]
    rounds = 50
    start = threading.Barrier(2)

    def work(xs: np.ndarray) -> None:
        start.wait(WAIT)
        for _ in range(rounds):
            cg = g.build({"xs": xs}, loss)
            cg.backward(cg.outputs[0])

    with frequent_switches():
        workers = [Worker(lambda xs=xs: work(xs)) for xs in feeds]
        for w in workers:
            w.start()
        for w in workers:
            w.outcome()
    for k, name in enumerate(("W", "U")):
        np.testing.assert_allclose(g.params[name].grad, rounds * (each[0][k] + each[1][k]), rtol=1e-12)


def test_the_mode_module_sits_at_the_bottom():
    """vgraph.modes imports nothing of vgraph but its errors (every layer may read the modes)."""
    import ast
    from pathlib import Path

    import vgraph.modes

    tree = ast.parse(Path(vgraph.modes.__file__).read_text())
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
    absolute = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
        n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
    }
    assert relative <= {"errors"}
    assert not any(str(m).startswith("vgraph") for m in absolute)
