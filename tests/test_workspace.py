"""Recycled buffers for large temporaries (vgraph.workspace, issue 10 §7).

A buffer is handed out again only when nothing refers to it: values and gradients a user holds
never change. And the engine's results do not depend on recycling: every example model trains
bitwise the same with every large-array path recycled (the size threshold lowered to zero) as
with recycling off.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_hoist import load
from test_tape import ROOT, STEPS, assert_records_equal, feeds_like, train

import vgraph as vg
from vgraph import workspace

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py

BIG = (256, 256)  # 512 KiB of float64: over MIN_BYTES


@pytest.fixture(autouse=True)
def fresh_pool():
    previous = workspace.limit()
    workspace.clear()
    yield
    workspace.set_limit(previous)
    workspace.clear()


@pytest.fixture
def recycle_everything(monkeypatch):
    """Every array the engine asks the workspace for is recycled, however small."""
    monkeypatch.setattr(workspace, "MIN_BYTES", 0)


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]  # not a reference: holding one keeps a buffer in use


def test_a_free_buffer_is_recycled():
    a = workspace.empty(BIG, np.float64)
    where = address(a)
    del a
    b = workspace.empty(BIG, np.float64)
    assert address(b) == where
    assert workspace.kept_bytes() == b.nbytes


def test_a_buffer_someone_refers_to_is_never_handed_out():
    a = workspace.zeros(BIG, np.float64)
    a[:] = 7.0
    view = a[3:5]  # a view keeps the buffer in use
    del a
    b = workspace.zeros(BIG, np.float64)
    assert not np.shares_memory(b, view)
    b[:] = 1.0
    assert np.all(view == 7.0)


def test_zeros_are_zero_in_a_recycled_buffer():
    a = workspace.empty(BIG, np.float64)
    a.fill(np.nan)
    del a
    z = workspace.zeros(BIG, np.float64)
    assert not np.any(z) and z.shape == BIG and z.dtype == np.float64


def test_other_shapes_and_dtypes_share_buffers_of_similar_size():
    a = workspace.empty((512, 128), np.float64)  # 512 KiB
    where = address(a)
    del a
    b = workspace.empty((256, 256, 2), np.float32)  # 512 KiB too
    assert address(b) == where and b.shape == (256, 256, 2) and b.dtype == np.float32
    assert b.flags.c_contiguous and b.flags.writeable
    del b
    half = workspace.empty((256, 128), np.float64)  # 256 KiB: a 512 KiB buffer is at most twice that
    assert address(half) == where
    del half
    small = workspace.empty((200, 128), np.float64)  # 200 KiB: less than half, a buffer of its own
    assert address(small) != where


def test_small_arrays_are_allocated_as_usual():
    a = workspace.empty((4, 4), np.float32)
    assert a.flags.owndata and workspace.kept_bytes() == 0


def test_the_limit_bounds_what_is_kept_and_zero_turns_recycling_off():
    workspace.set_limit(4 * 2**20)  # 4 MiB: four 1 MiB buffers fit
    held = [workspace.empty((128, 1024), np.float64) for _ in range(6)]
    assert workspace.kept_bytes() == 4 * 2**20
    assert all(h.shape == (128, 1024) for h in held)
    workspace.set_limit(0)
    assert workspace.kept_bytes() == 0
    a = workspace.empty(BIG, np.float64)
    assert a.flags.owndata  # a plain array
    held[0].fill(1.0)  # arrays from forgotten buffers stay valid
    assert held[0].sum() == held[0].size


def test_an_array_over_a_quarter_of_the_limit_is_allocated_as_usual():
    workspace.set_limit(4 * 2**20)
    at_quarter = workspace.empty((128, 1024), np.float64)  # 1 MiB: kept
    assert not at_quarter.flags.owndata and workspace.kept_bytes() == 2**20
    over = workspace.empty((128, 1025), np.float64)  # just over 1 MiB: a plain array
    assert over.flags.owndata and workspace.kept_bytes() == 2**20
    zeros = workspace.zeros((128, 1025), np.float64)
    assert zeros.flags.owndata and not zeros.any() and workspace.kept_bytes() == 2**20


def test_the_number_of_buffers_is_bounded():
    held = [workspace.empty((16, 1024 + i), np.float64) for i in range(workspace.MAX_BUFFERS + 5)]
    assert len(workspace._pool.buffers) <= workspace.MAX_BUFFERS
    assert len(held) == workspace.MAX_BUFFERS + 5


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_set_limit_checks_its_argument(bad):
    with pytest.raises(TypeError if not isinstance(bad, int) or isinstance(bad, bool) else ValueError):
        workspace.set_limit(bad)


def test_each_thread_has_its_own_buffers():
    a = workspace.empty(BIG, np.float64)
    where = address(a)
    del a
    seen = []
    t = threading.Thread(target=lambda: seen.append(address(workspace.empty(BIG, np.float64))))
    t.start()
    t.join()
    assert seen[0] != where
    assert address(workspace.empty(BIG, np.float64)) == where


# ---------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("script", sorted((ROOT / "examples" / "models").glob("*.py")), ids=lambda p: p.stem)
def test_models_train_the_same_with_every_buffer_recycled(script, recycle_everything):
    def run(limit: int):
        workspace.set_limit(limit)
        workspace.clear()
        g, feed, outputs = load(script).build()
        return train(g, feeds_like(feed, STEPS), outputs[0], outputs)

    assert_records_equal(run(0), run(256 << 20))


def elman(T: int = 6, B: int = 3):
    g = vg.VirtualGraph(dtype=np.float64, seed=3)
    x = g.input("x", shape=(None, B, 4))
    Wx, Wh = g.parameter("Wx", (4, 5)), g.parameter("Wh", (5, 5))
    b = g.parameter("b", (5,), init="normal")
    with g.loop(name="t") as L:
        h = L.carry(g.constant(np.zeros((B, 5))), name="h")
        xw = L.step(x) @ Wx  # hoisted: one (T*B, 4) @ (4, 5) product for every step
        L.update(h, vg.tanh(xw + h @ Wh + b))
    loss = (L.final(h) ** 2).sum()
    feed = {"x": np.random.default_rng(0).standard_normal((T, B, 4))}
    return g, loss, xw, feed


def test_values_and_gradients_a_user_holds_never_change(recycle_everything):
    """Everything read from a graph before a later step — a hoisted product's per-step value, the
    group it is a view of, a retained gradient, a parameter gradient — keeps its contents while
    the graph runs on with other data (the buffers under them are not recycled)."""
    g, loss, xw, feed = elman()
    cg = g.build(feed, loss)
    node = cg.node(xw, (2,))
    node.retain_grad()
    cg.backward(loss)
    held = {
        "value": node.value,
        "grad": node.grad,
        "Wh.grad": g.params["Wh"].grad,
        "Wx.grad": g.params["Wx"].grad,
    }
    snapshot = {k: np.array(v, copy=True) for k, v in held.items()}
    for f in feeds_like(feed, 4, seed=1):
        g.params.zero_grad()
        cg.feed(f)
        cg.forward()
        cg.backward(loss)
    assert not np.array_equal(node.value, snapshot["value"])  # the graph did move on
    for k, v in held.items():
        assert np.array_equal(v, snapshot[k]), k


def test_recycling_is_used_by_a_hoisted_loop(recycle_everything):
    """The stacked weight-gradient rows and the hoisted group's gradient come from the workspace
    (and are recycled step after step: the pool stops growing)."""
    g, loss, _, feed = elman()
    cg = g.build(feed, loss)
    sizes = []
    for f in feeds_like(feed, 6, seed=2):
        g.params.zero_grad()
        cg.feed(f)
        cg.forward()
        cg.backward(loss)
        sizes.append(len(workspace._pool.buffers))
    assert sizes[0] > 0
    assert sizes[-1] == sizes[-2] == sizes[-3]


# ---------------------------------------------------------------------------- huge pages

madvise = pytest.importorskip("numpy._core.multiarray")
get_advice, set_advice = madvise._get_madvise_hugepage, madvise._set_madvise_hugepage


@pytest.fixture
def advice():
    """numpy's huge-page advice on (numpy's Linux default) and vgraph's policy at its default;
    both as they were afterwards."""
    was, policy = set_advice(True), workspace.huge_pages()
    workspace.set_huge_pages(False)
    yield
    set_advice(was)
    workspace.set_huge_pages(policy)


def recording_op():
    """An op that records numpy's huge-page advice in its forward and VJP, and what it saw."""
    seen: list[tuple[str, bool]] = []

    def forward(x):
        seen.append(("forward", get_advice()))
        return x * 2.0

    def vjp(g, ans, x):
        seen.append(("vjp", get_advice()))
        return g * 2.0

    return vg.defop("RecordAdvice", forward, vjp, replace=True), seen


def model_with(double):
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", shape=(3,))
    w = g.parameter("w", (3,), init="normal")
    return g, (double(x * w)).sum()


def recording_model():
    """A model whose op records numpy's huge-page advice in its forward and VJP."""
    double, seen = recording_op()
    return (*model_with(double), seen)


def test_vgraph_computes_without_huge_page_advice_and_restores_it(advice):
    g, loss, seen = recording_model()
    cg = g.build({"x": np.arange(3.0)}, loss, cache=False)
    assert get_advice() is True
    opt = vg.optim.Adam(g.params)
    cg.backward(cg.outputs[0])
    assert get_advice() is True
    cg.forward(cg.outputs[0])  # nothing changed: nothing recomputed
    opt.step()
    cg.forward(cg.outputs[0])  # the parameter changed: recomputed
    cg.grad(cg.outputs[0], [cg.outputs[0]])
    assert get_advice() is True
    assert seen == [("forward", False), ("vjp", False), ("forward", False)]


def test_a_user_setting_is_left_alone(advice):
    g, loss, seen = recording_model()
    set_advice(False)  # the user turned numpy's advice off: vgraph keeps it off and leaves it off
    cg = g.build({"x": np.arange(3.0)}, loss, cache=False)
    cg.backward(cg.outputs[0])
    assert get_advice() is False
    set_advice(True)
    workspace.set_huge_pages(True)  # vgraph's work lets numpy advise as numpy is set
    cg = g.build({"x": np.arange(3.0)}, loss, cache=False)
    cg.backward(cg.outputs[0])
    assert seen == [("forward", False), ("vjp", False), ("forward", True), ("vjp", True)]
    assert get_advice() is True


def test_nested_scopes_restore_the_advice_only_when_the_outermost_exits(advice):
    with workspace.compute_scope:
        with workspace.compute_scope:  # e.g. a build that re-runs a cached graph's forward
            assert get_advice() is False
        assert get_advice() is False
    assert get_advice() is True


def test_the_advice_is_restored_when_a_build_or_backward_fails(advice):
    def forward(x):
        raise ValueError("no")

    bad = vg.defop("FailsForward", forward, lambda g, ans, x: g, replace=True)
    g = vg.VirtualGraph(dtype=np.float64)
    x = g.input("x", shape=(3,))
    with pytest.raises(vg.VGraphError):
        g.build({"x": np.zeros(3)}, bad(x), cache=False)
    assert get_advice() is True

    fails_vjp = vg.defop("FailsVJP", lambda x: x + 0.0, lambda g, ans, x: 1 / 0, replace=True)
    w = g.parameter("w", (3,), init="normal")
    loss = fails_vjp(x * w).sum()
    cg = g.build({"x": np.zeros(3)}, loss, cache=False)
    with pytest.raises(vg.VGraphError):
        cg.backward(cg.outputs[0])
    assert get_advice() is True


def test_the_advice_is_restored_after_builds_in_several_threads(advice):
    """The outermost scope in the process restores numpy's setting, however the threads' scopes
    overlap; inside any of them the advice is off."""
    double, seen = recording_op()
    models = [model_with(double) for _ in range(4)]  # a graph per thread (one op)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(g, loss):
        try:
            start.wait()
            for _ in range(20):
                cg = g.build({"x": np.arange(3.0)}, loss, cache=False)
                cg.backward(cg.outputs[0])
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=m) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert get_advice() is True
    assert len(seen) == 4 * 20 * 2 and not any(on for _, on in seen)


def test_set_huge_pages_checks_its_argument():
    with pytest.raises(TypeError, match="must be a bool"):
        workspace.set_huge_pages(1)  # type: ignore[arg-type]


@pytest.mark.parametrize("env, expected", [(None, False), ("0", True), ("1", True)])
def test_numpys_environment_switch_means_vgraph_leaves_the_advice_alone(env, expected):
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        environ["NUMPY_MADVISE_HUGEPAGE"] = env
    out = subprocess.run(
        [sys.executable, "-c", "import vgraph; print(vgraph.workspace.huge_pages())"],
        env=environ, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == str(expected)
