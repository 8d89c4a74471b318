"""Optimisers, clipping and schedules against their update formulas written out in numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest

import vgraph as vg
from vgraph import nn, optim

STEPS = 3


def make_params(dtype=np.float64, seed=0):
    """Two free parameter leaves (as a ParameterStore holds them) and 3 steps of gradients."""
    rng = np.random.default_rng(seed)
    cg = vg.ComputeGraph(dtype)
    a = cg.parameter(rng.standard_normal((3, 2)), name="a")
    b = cg.parameter(rng.standard_normal((4,)), name="b")
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal((4,))] for _ in range(STEPS)]
    return [a, b], grads


def run(opt, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = np.array(gr, dtype=p.value.dtype)
        opt.step()
    return [np.array(p.value) for p in params]


# --- reference formulas (plain numpy, one parameter at a time) -----------------------------


def ref_sgd(theta, grads, lr, momentum=0.0, dampening=0.0, nesterov=False, wd=0.0):
    theta = theta.copy()
    buf = None
    for g in grads:
        g = g + wd * theta
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        theta = theta - lr * g
    return theta


def ref_adam(theta, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    theta = theta.copy()
    m = np.zeros_like(theta)
    v = np.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            theta = theta - lr * wd * theta
        else:
            g = g + wd * theta
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        theta = theta - lr * m_hat / (np.sqrt(v_hat) + eps)
    return theta


def ref_rmsprop(theta, grads, lr, alpha, eps, wd=0.0, momentum=0.0, centered=False):
    theta = theta.copy()
    v = np.zeros_like(theta)
    gavg = np.zeros_like(theta)
    b = np.zeros_like(theta)
    for g in grads:
        g = g + wd * theta
        v = alpha * v + (1 - alpha) * g**2
        vt = v
        if centered:
            gavg = alpha * gavg + (1 - alpha) * g
            vt = v - gavg**2
        if momentum > 0:
            b = momentum * b + g / (np.sqrt(vt) + eps)
            theta = theta - lr * b
        else:
            theta = theta - lr * g / (np.sqrt(vt) + eps)
    return theta


def ref_adagrad(theta, grads, lr, lr_decay=0.0, wd=0.0, init_acc=0.0, eps=1e-10):
    theta = theta.copy()
    s = np.full_like(theta, init_acc)
    for t, g in enumerate(grads, start=1):
        clr = lr / (1 + (t - 1) * lr_decay)
        g = g + wd * theta
        s = s + g**2
        theta = theta - clr * g / (np.sqrt(s) + eps)
    return theta


CASES = [
    ("sgd", lambda ps: optim.SGD(ps, lr=0.1), lambda th, gs: ref_sgd(th, gs, 0.1)),
    ("sgd-momentum", lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
     lambda th, gs: ref_sgd(th, gs, 0.1, momentum=0.9)),
    ("sgd-dampening-wd", lambda ps: optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.1),
     lambda th, gs: ref_sgd(th, gs, 0.05, momentum=0.8, dampening=0.3, wd=0.1)),
    ("sgd-nesterov-wd", lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
     lambda th, gs: ref_sgd(th, gs, 0.1, momentum=0.9, nesterov=True, wd=0.01)),
    ("adam", lambda ps: optim.Adam(ps, lr=0.01), lambda th, gs: ref_adam(th, gs, 0.01, 0.9, 0.999, 1e-8)),
    ("adam-wd", lambda ps: optim.Adam(ps, lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     lambda th, gs: ref_adam(th, gs, 0.02, 0.8, 0.99, 1e-6, wd=0.1)),
    ("adamw", lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
     lambda th, gs: ref_adam(th, gs, 0.01, 0.9, 0.999, 1e-8, wd=0.1, decoupled=True)),
    ("adamw-default-decay", lambda ps: optim.AdamW(ps, lr=0.1),
     lambda th, gs: ref_adam(th, gs, 0.1, 0.9, 0.999, 1e-8, wd=1e-2, decoupled=True)),
    ("rmsprop", lambda ps: optim.RMSprop(ps, lr=0.01), lambda th, gs: ref_rmsprop(th, gs, 0.01, 0.99, 1e-8)),
    ("rmsprop-centered-momentum-wd",
     lambda ps: optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.5, centered=True),
     lambda th, gs: ref_rmsprop(th, gs, 0.01, 0.9, 1e-6, wd=0.1, momentum=0.5, centered=True)),
    ("adagrad", lambda ps: optim.Adagrad(ps, lr=0.1), lambda th, gs: ref_adagrad(th, gs, 0.1)),
    ("adagrad-decay-wd-acc",
     lambda ps: optim.Adagrad(ps, lr=0.1, lr_decay=0.5, weight_decay=0.2, initial_accumulator_value=0.3),
     lambda th, gs: ref_adagrad(th, gs, 0.1, lr_decay=0.5, wd=0.2, init_acc=0.3)),
]  # fmt: skip


@pytest.mark.parametrize("name,make,ref", CASES, ids=[c[0] for c in CASES])
def test_update_formula_three_steps(name, make, ref):
    params, grads = make_params()
    start = [np.array(p.value) for p in params]
    got = run(make(params), params, grads)
    for i in range(len(params)):
        expected = ref(start[i], [step[i] for step in grads])
        np.testing.assert_allclose(got[i], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,make,ref", CASES, ids=[c[0] for c in CASES])
def test_float32_parameters_stay_float32(name, make, ref):
    params, grads = make_params(np.float32)
    start = [np.array(p.value, dtype=np.float64) for p in params]
    got = run(make(params), params, grads)
    for i, p in enumerate(params):
        assert p.value.dtype == np.float32
        expected = ref(start[i], [np.float32(step[i]).astype(np.float64) for step in grads])
        np.testing.assert_allclose(got[i], expected, rtol=2e-4, atol=1e-5)


def test_first_momentum_step_is_the_gradient():
    (a, _), grads = make_params()
    a0 = np.array(a.value)
    opt = optim.SGD([a], lr=0.5, momentum=0.9, dampening=0.5)
    a.grad = grads[0][0]
    opt.step()
    np.testing.assert_allclose(a.value, a0 - 0.5 * grads[0][0])  # no dampening on the first step


def test_adam_bias_correction_first_step_is_lr_times_sign():
    (a, _), _ = make_params()
    a0 = np.array(a.value)
    a.grad = np.full(a.shape, 3.0)
    optim.Adam([a], lr=0.01, eps=0.0).step()
    # m_hat = g, v_hat = g^2 after bias correction: the first step is exactly lr * sign(g).
    np.testing.assert_allclose(a.value, a0 - 0.01)


def test_skips_parameters_without_gradient_and_keeps_their_state_fresh():
    params, grads = make_params()
    a, b = params
    b0 = np.array(b.value)
    opt = optim.Adam(params, lr=0.01)
    a.grad = grads[0][0]
    b.grad = None
    opt.step()
    np.testing.assert_array_equal(b.value, b0)
    # b's first real step is its step 1 (bias correction with t=1), whatever a did before.
    b.grad = grads[1][1]
    a.grad = None
    opt.step()
    np.testing.assert_allclose(b.value, ref_adam(b0, [grads[1][1]], 0.01, 0.9, 0.999, 1e-8))


def test_subset_binding_leaves_the_others_unchanged():
    params, grads = make_params()
    a, b = params
    b0 = np.array(b.value)
    opt = optim.SGD([a], lr=0.1, momentum=0.9)
    run(opt, params, grads)
    np.testing.assert_array_equal(b.value, b0)
    assert b.grad is not None  # not even its gradient is touched
    opt.zero_grad()
    assert a.grad is None and b.grad is not None


def test_step_bumps_version_and_never_mutates_old_arrays():
    cg = vg.ComputeGraph(np.float64)
    w = cg.parameter(np.array([1.0, 2.0]))
    loss = (w * w).sum()
    cg.backward(loss)
    before = w.value
    version = w.version
    optim.SGD([w], lr=0.25).step()
    assert w.version > version
    np.testing.assert_array_equal(before, [1.0, 2.0])  # the array read earlier is intact
    np.testing.assert_allclose(w.value, [0.5, 1.0])
    assert cg.forward(loss) == pytest.approx(1.25)  # dirty checking sees the new value


def test_zero_grad_clears_all_bound():
    params, grads = make_params()
    for p, gr in zip(params, grads[0]):
        p.grad = gr
    optim.SGD(params, lr=1).zero_grad()
    assert all(p.grad is None for p in params)


def test_store_is_reread_every_step_so_later_untied_parameters_are_updated():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, 2))
    zeros = g.constant(np.zeros(2))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(zeros, name="h")
        w = g.parameter("w", (2,), init="normal")  # untied: one per iteration
        L.update(h, h + w * xt)
    loss = (L.final(h) ** 2).sum()
    opt = optim.SGD(g.params, lr=0.1)
    cg = g.build({"x": np.ones((1, 2))}, loss)
    cg.backward(loss)
    opt.step()
    assert list(g.params) == ["w@0"]
    cg = g.build({"x": np.ones((3, 2))}, loss)  # creates w@1, w@2
    w_new = {k: np.array(g.params[k].value) for k in ("w@1", "w@2")}
    opt.zero_grad()
    cg.backward(loss)
    grads = {k: np.array(g.params[k].grad) for k in w_new}
    opt.step()
    for k in w_new:
        np.testing.assert_allclose(g.params[k].value, w_new[k] - 0.1 * grads[k])


def test_module_and_virtual_parameter_binding():
    g = vg.VirtualGraph(dtype=np.float64)
    a = nn.Linear(g, 2, 2, "a")
    b = nn.Linear(g, 2, 2, "b")
    x = g.input("x", (None, 2))
    loss = (b(a(x)) ** 2).sum()
    cg = g.build({"x": np.ones((3, 2))}, loss)
    cg.backward(loss)
    before = g.params.state_dict()
    optim.SGD(a, lr=0.1).step()  # a module
    optim.SGD([b.b], lr=0.1).step()  # a virtual parameter node
    after = g.params.state_dict()
    assert not np.allclose(after["a.W"], before["a.W"])
    assert not np.allclose(after["b.b"], before["b.b"])
    np.testing.assert_array_equal(after["b.W"], before["b.W"])


def test_invalid_arguments():
    params, _ = make_params()
    with pytest.raises(ValueError):
        optim.SGD(params, lr=-1)
    with pytest.raises(ValueError):
        optim.SGD(params, lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        optim.Adam(params, betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        optim.RMSprop(params, alpha=-0.1)
    with pytest.raises(ValueError):
        optim.SGD([], lr=0.1)
    cg = vg.ComputeGraph()
    with pytest.raises(TypeError):
        optim.SGD([cg.parameter(np.ones(3)) * 2], lr=0.1)  # an op node, not a leaf
    with pytest.raises(TypeError):
        optim.SGD([np.zeros(3)], lr=0.1)


def test_duplicates_are_updated_once():
    (a, _), grads = make_params()
    a0 = np.array(a.value)
    a.grad = grads[0][0]
    optim.SGD([a, a], lr=0.1).step()
    np.testing.assert_allclose(a.value, a0 - 0.1 * grads[0][0])


# --- clipping ---------------------------------------------------------------------------------


def test_clip_grad_norm_scales_jointly():
    params, grads = make_params()
    a, b = params
    a.grad, b.grad = np.array(grads[0][0]), np.array(grads[0][1])
    expected_total = math.sqrt(np.sum(grads[0][0] ** 2) + np.sum(grads[0][1] ** 2))
    total = optim.clip_grad_norm(params, max_norm=0.5)
    assert total == pytest.approx(expected_total)
    scale = 0.5 / (expected_total + 1e-6)
    np.testing.assert_allclose(a.grad, grads[0][0] * scale)
    np.testing.assert_allclose(b.grad, grads[0][1] * scale)
    new_norm = math.sqrt(np.sum(a.grad**2) + np.sum(b.grad**2))
    assert new_norm == pytest.approx(0.5, rel=1e-5)


def test_clip_grad_norm_below_threshold_and_none_grads():
    params, grads = make_params()
    a, b = params
    a.grad = np.array(grads[0][0])
    b.grad = None
    total = optim.clip_grad_norm(params, max_norm=1e6)
    assert total == pytest.approx(np.linalg.norm(grads[0][0]))
    np.testing.assert_array_equal(a.grad, grads[0][0])
    assert b.grad is None
    assert optim.clip_grad_norm([b], 1.0) == 0.0


def test_clip_grad_norm_inf_and_errors():
    params, grads = make_params()
    for p, gr in zip(params, grads[0]):
        p.grad = np.array(gr)
    largest = max(np.abs(grads[0][0]).max(), np.abs(grads[0][1]).max())
    assert optim.clip_grad_norm(params, 0.1, norm_type=float("inf")) == pytest.approx(largest)
    assert max(np.abs(p.grad).max() for p in params) == pytest.approx(0.1, rel=1e-5)
    with pytest.raises(ValueError):
        optim.clip_grad_norm(params, 0)


def test_clip_grad_value():
    params, grads = make_params()
    for p, gr in zip(params, grads[0]):
        p.grad = np.array(gr)
    optim.clip_grad_value(params, 0.3)
    for p, gr in zip(params, grads[0]):
        np.testing.assert_array_equal(p.grad, np.minimum(np.maximum(gr, -0.3), 0.3))
    with pytest.raises(ValueError):
        optim.clip_grad_value(params, -1)


# --- schedules --------------------------------------------------------------------------------


def test_step_lr():
    params, _ = make_params()
    opt = optim.SGD(params, lr=1.0)
    sched = optim.StepLR(opt, step_size=2, gamma=0.5)
    lrs = [opt.lr] + [sched.step() for _ in range(6)]
    assert lrs == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.125])
    assert sched.get_last_lr() == opt.lr


def test_cosine_annealing():
    params, _ = make_params()
    opt = optim.Adam(params, lr=0.1)
    sched = optim.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)
    lrs = [opt.lr] + [sched.step() for _ in range(4)]
    expected = [0.01 + 0.09 * (1 + math.cos(math.pi * e / 4)) / 2 for e in range(5)]
    assert lrs == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(0.01)


def test_schedule_drives_the_update():
    (a, _), grads = make_params()
    a0 = np.array(a.value)
    opt = optim.SGD([a], lr=1.0)
    sched = optim.StepLR(opt, step_size=1, gamma=0.1)
    expected = a0.copy()
    for t in range(3):
        a.grad = grads[t][0]
        opt.step()
        expected = expected - (0.1**t) * grads[t][0]
        sched.step()
    np.testing.assert_allclose(a.value, expected)


# --- a refused step changes nothing (issue 9 §2, §6) -------------------------------------------

ALL_OPTIMISERS = [
    ("sgd-momentum", lambda ps, **kw: optim.SGD(ps, lr=0.1, momentum=0.9, **kw)),
    ("sgd-nesterov-wd", lambda ps, **kw: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, **kw)),
    ("adam", lambda ps, **kw: optim.Adam(ps, lr=0.01, **kw)),
    ("adamw", lambda ps, **kw: optim.AdamW(ps, lr=0.01, **kw)),
    ("rmsprop-centered-momentum",
     lambda ps, **kw: optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True, **kw)),
    ("adagrad", lambda ps, **kw: optim.Adagrad(ps, lr=0.1, **kw)),
]  # fmt: skip


def snapshot(opt, params):
    """Parameter values and the whole optimiser state, as independent copies."""
    values = [np.array(p.value) for p in params]
    state = {k: {n: (np.array(v) if isinstance(v, np.ndarray) else v) for n, v in st.items() if n != "node"}
             for k, st in opt.state.items()}  # fmt: skip
    return values, state


def assert_same_snapshot(a, b):
    (va, sa), (vb, sb) = a, b
    for x, y in zip(va, vb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n in sa[k]:
            np.testing.assert_array_equal(sa[k][n], sb[k][n])


def one_good_step(opt, params, grads):
    for p, gr in zip(params, grads):
        p.grad = np.array(gr, dtype=p.value.dtype)
    opt.step()


@pytest.mark.parametrize("name,make", ALL_OPTIMISERS, ids=[c[0] for c in ALL_OPTIMISERS])
def test_wrong_shaped_gradient_refuses_the_whole_step(name, make):
    params, grads = make_params()
    a, b = params
    a.name, b.name = "enc.W", "enc.b"
    opt = make(params)
    one_good_step(opt, params, grads[0])  # state exists for both
    before = snapshot(opt, params)
    a.grad = np.array(grads[1][0])  # the first parameter's gradient is fine ...
    b.grad = np.ones((4, 1))  # ... the second one's broadcasts but is the wrong shape
    with pytest.raises(vg.ShapeError, match=r"'enc\.b'.*\(4, 1\).*\(4,\)"):
        opt.step()
    assert_same_snapshot(snapshot(opt, params), before)  # not even the first parameter moved
    # The next good step is exactly the step that would have happened without the refused one.
    ref_params, _ = make_params()
    ref = make(ref_params)
    one_good_step(ref, ref_params, grads[0])
    one_good_step(ref, ref_params, grads[1])
    one_good_step(opt, params, grads[1])
    for p, q in zip(params, ref_params):
        np.testing.assert_array_equal(p.value, q.value)


@pytest.mark.parametrize("name,make", ALL_OPTIMISERS, ids=[c[0] for c in ALL_OPTIMISERS])
def test_wrong_shape_on_the_first_step_creates_no_state(name, make):
    params, grads = make_params()
    opt = make(params)
    params[0].grad = np.array(grads[0][0])
    params[1].grad = np.ones(5)
    before = snapshot(opt, params)
    with pytest.raises(vg.ShapeError, match="shape"):
        opt.step()
    assert opt.state == {}
    assert_same_snapshot(snapshot(opt, params), before)
    one_good_step(opt, params, grads[0])
    assert len(opt.state) == 2


@pytest.mark.parametrize(
    "bad", [np.array([1 + 2j] * 4), np.array(["a"] * 4), np.ones(4, dtype=bool), [[1], [2, 3]]]
)
def test_non_numeric_gradient_is_a_type_error_naming_the_parameter(bad):
    params, grads = make_params()
    params[1].name = "b"
    opt = optim.Adam(params, lr=0.1)
    params[0].grad = np.array(grads[0][0])
    params[1].grad = bad
    before = snapshot(opt, params)
    with pytest.raises(TypeError, match="'b'"):
        opt.step()
    assert_same_snapshot(snapshot(opt, params), before)


@pytest.mark.parametrize("name,make", ALL_OPTIMISERS, ids=[c[0] for c in ALL_OPTIMISERS])
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_check_finite_refuses_non_finite_gradients(name, make, poison):
    params, grads = make_params()
    params[0].name = "W"
    opt = make(params, check_finite=True)
    one_good_step(opt, params, grads[0])
    before = snapshot(opt, params)
    params[0].grad = np.array(grads[1][0])
    params[0].grad[1, 0] = poison
    params[1].grad = np.array(grads[1][1])
    with pytest.raises(optim.NonFiniteGradientError, match="'W'") as info:
        opt.step()
    assert isinstance(info.value, vg.VGraphError)
    assert_same_snapshot(snapshot(opt, params), before)
    one_good_step(opt, params, grads[1])  # the next good step works
    assert all(np.isfinite(p.value).all() for p in params)


def test_check_finite_sees_overflow_when_casting_to_the_parameter_dtype():
    params, _ = make_params(np.float32)
    opt = optim.SGD(params[:1], lr=0.1, check_finite=True)
    params[0].grad = np.full((3, 2), 1e39)  # finite in float64, inf in float32
    with pytest.raises(optim.NonFiniteGradientError):
        opt.step()


def test_without_check_finite_a_nan_gradient_is_applied():
    params, _ = make_params()
    opt = optim.SGD(params[:1], lr=0.1)
    params[0].grad = np.full((3, 2), np.nan)
    opt.step()  # the default: no per-step scan (PyTorch's behaviour)
    assert np.isnan(params[0].value).all()


# --- argument checking (issue 9 §3) -------------------------------------------------------------


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda ps: optim.SGD(ps, lr="0.1"), TypeError, "lr must be a real number, got str"),
        (lambda ps: optim.SGD(ps, lr=None), TypeError, "lr"),
        (lambda ps: optim.SGD(ps, lr=True), TypeError, "lr"),
        (lambda ps: optim.SGD(ps, lr=float("nan")), ValueError, "lr"),
        (lambda ps: optim.SGD(ps, lr=float("inf")), ValueError, "lr"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=-0.5), ValueError, "momentum"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=1.5), ValueError, "momentum"),
        (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov="yes"), TypeError, "nesterov"),
        (lambda ps: optim.SGD(ps, lr=0.1, dampening=2.0), ValueError, "dampening"),
        (lambda ps: optim.Adam(ps, betas=(0.9,)), ValueError, "betas must be a pair.*1 value"),
        (lambda ps: optim.Adam(ps, betas=(0.9, 0.99, 0.999)), ValueError, "betas"),
        (lambda ps: optim.Adam(ps, betas=0.9), TypeError, "betas must be a pair"),
        (lambda ps: optim.Adam(ps, betas="ab"), TypeError, "betas"),
        (lambda ps: optim.Adam(ps, betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
        (lambda ps: optim.Adam(ps, eps=-1e-8), ValueError, "eps"),
        (lambda ps: optim.AdamW(ps, weight_decay="0.01"), TypeError, "weight_decay"),
        (lambda ps: optim.RMSprop(ps, alpha=1.5), ValueError, "alpha"),
        (lambda ps: optim.RMSprop(ps, centered=1), TypeError, "centered"),
        (lambda ps: optim.Adagrad(ps, lr_decay=-1), ValueError, "lr_decay"),
        (lambda ps: optim.Adagrad(ps, initial_accumulator_value=-1), ValueError, "initial_accumulator_value"),
        (lambda ps: optim.Adam(ps, check_finite="no"), TypeError, "check_finite"),
        (lambda ps: optim.Adam("g.params"), TypeError, "params must be"),
        (lambda ps: optim.Adam({"W": ps[0]}), TypeError, "params must be"),
        (lambda ps: optim.StepLR(optim.SGD(ps, lr=1), step_size="5"), TypeError, "step_size"),
        (lambda ps: optim.StepLR(optim.SGD(ps, lr=1), step_size=2.5), ValueError, "step_size"),
        (lambda ps: optim.StepLR(optim.SGD(ps, lr=1), step_size=0), ValueError, "step_size"),
        (lambda ps: optim.StepLR(optim.SGD(ps, lr=1), step_size=2, gamma=-1), ValueError, "gamma"),
        (lambda ps: optim.CosineAnnealingLR(optim.SGD(ps, lr=1), T_max=None), TypeError, "T_max"),
        (lambda ps: optim.CosineAnnealingLR(optim.SGD(ps, lr=1), T_max=3, eta_min=-1), ValueError, "eta_min"),
        (lambda ps: optim.StepLR("opt", step_size=2), TypeError, "optimiser"),
        (lambda ps: optim.clip_grad_norm_(ps, "1.0"), TypeError, "max_norm"),
        (lambda ps: optim.clip_grad_norm_(ps, 1.0, norm_type=0), ValueError, "norm_type"),
        (lambda ps: optim.clip_grad_value_(ps, None), TypeError, "clip_value"),
    ],
)
def test_bad_arguments_are_typed_errors_naming_the_argument(call, error, match):
    params, _ = make_params()
    with pytest.raises(error, match=match):
        call(params)


def test_setting_lr_later_is_checked():
    params, _ = make_params()
    opt = optim.SGD(params, lr=0.1)
    with pytest.raises(TypeError, match="lr"):
        opt.lr = "0.01"
    assert opt.lr == 0.1
    opt.lr = 0.01
    assert opt.lr == 0.01
    assert (
        optim.StepLR(
            opt,
            step_size=2,
            gamma=0.5,
        ).step()
        == 0.01
    )  # integral floats as ints are fine
    assert optim.StepLR(opt, step_size=2.0).step_size == 2


# --- clipping names ------------------------------------------------------------------------------


def test_pytorch_clip_names_are_canonical_and_old_names_alias_them():
    assert optim.clip_grad_norm is optim.clip_grad_norm_
    assert optim.clip_grad_value is optim.clip_grad_value_
    assert optim.clip_grad_norm_.__name__ == "clip_grad_norm_"


def test_clip_grad_norm_error_if_nonfinite_leaves_gradients():
    params, grads = make_params()
    params[0].grad = np.array(grads[0][0])
    params[0].grad[0, 0] = np.nan
    params[1].grad = np.array(grads[0][1])
    before = [np.array(p.grad) for p in params]
    with pytest.raises(optim.NonFiniteGradientError, match="'a'"):
        optim.clip_grad_norm_(params, 0.1, error_if_nonfinite=True)
    for p, g0 in zip(params, before):
        np.testing.assert_array_equal(p.grad, g0)


# --- readable objects ------------------------------------------------------------------------------


def test_optimizer_repr_lists_hyper_parameters_and_parameter_count():
    params, _ = make_params()
    text = repr(optim.Adam(params, lr=0.01, betas=(0.8, 0.99)))
    assert text.splitlines()[0] == "Adam ("
    assert "parameters: 2 (10 values)" in text  # (3, 2) and (4,)
    assert "lr: 0.01" in text and "betas: (0.8, 0.99)" in text and "eps: 1e-08" in text
    assert "weight_decay: 0.0" in text and "check_finite: False" in text
    assert "object at 0x" not in text
    sched = optim.StepLR(optim.SGD(params, lr=1.0), step_size=3, gamma=0.5)
    assert repr(sched) == "StepLR(step_size=3, gamma=0.5, base_lr=1.0, last_epoch=0, lr=1.0)"


# --- state_dict / load_state_dict (issue 14) ------------------------------------------------------


@pytest.mark.parametrize("name,make", ALL_OPTIMISERS, ids=[c[0] for c in ALL_OPTIMISERS])
def test_state_dict_round_trip_continues_bit_for_bit(name, make):
    params, grads = make_params(seed=1)
    for p, n in zip(params, ("W", "b")):
        p.name = n
    opt = make(params)
    one_good_step(opt, params, grads[0])
    one_good_step(opt, params, grads[1])
    sd = opt.state_dict()
    assert set(sd["state"]) == {"W", "b"} and sd["state"]["W"]["step"] == 2
    values = [np.array(p.value) for p in params]
    one_good_step(opt, params, grads[2])
    expected = [np.array(p.value) for p in params]
    # A fresh optimiser, with the saved values and state, takes the same third step.
    fresh, _ = make_params(seed=5)
    for p, n, v in zip(fresh, ("W", "b"), values):
        p.name = n
        p.value = v
    opt2 = make(fresh, check_finite=True)
    opt2.lr = 123.0  # hyper-parameters come from the state dict
    opt2.load_state_dict(sd)
    assert opt2.lr == opt.lr
    one_good_step(opt2, fresh, grads[2])
    for p, e in zip(fresh, expected):
        np.testing.assert_array_equal(p.value, e)


def test_state_dict_is_a_copy():
    params, grads = make_params()
    opt = optim.Adam(params, lr=0.1)
    one_good_step(opt, params, grads[0])
    sd = opt.state_dict()
    m = np.array(sd["state"]["a"]["exp_avg"])
    one_good_step(opt, params, grads[1])
    np.testing.assert_array_equal(sd["state"]["a"]["exp_avg"], m)


def test_parameters_without_distinct_names_are_keyed_by_position():
    params, grads = make_params()
    params[1].name = "a"
    opt = optim.SGD(params, lr=0.1, momentum=0.9)
    one_good_step(opt, params, grads[0])
    assert set(opt.state_dict()["state"]) == {"0", "1"}  # as PyTorch does


def _adam_sd():
    params, grads = make_params()
    params[0].name, params[1].name = "W", "b"
    opt = optim.Adam(params, lr=0.1)
    one_good_step(opt, params, grads[0])
    return params, opt, opt.state_dict()


@pytest.mark.parametrize(
    "corrupt,error,match",
    [
        (lambda sd: sd.update(optimizer="SGD"), ValueError, "of a SGD optimiser; this one is Adam"),
        (lambda sd: sd["hyperparameters"].update(lr="fast"), TypeError, "lr"),
        (lambda sd: sd["hyperparameters"].update(betas=(0.9,)), ValueError, "betas"),
        (lambda sd: sd["hyperparameters"].pop("eps"), ValueError, "hyper-parameters must be"),
        (lambda sd: sd["state"]["b"].pop("exp_avg_sq"), ValueError, "'b' has"),
        (lambda sd: sd["state"]["b"].update(step=0), ValueError, "step"),
        (lambda sd: sd["state"]["b"].update(step="1"), TypeError, "step"),
        (lambda sd: sd["state"]["b"].update(exp_avg=np.zeros(5)), vg.ShapeError, r"'b'.*\(5,\).*\(4,\)"),
        (lambda sd: sd["state"]["b"].update(exp_avg=np.zeros(4, np.float32)), TypeError, "dtype"),
        (lambda sd: sd["state"]["b"].update(exp_avg=[0, 0, 0, 0]), TypeError, "float array"),
        (lambda sd: sd["state"].update(decoder=sd["state"]["b"]), ValueError, "'decoder'.*does not update"),
        (lambda sd: sd.pop("state"), ValueError, "not an optimiser state dict"),
    ],
)
def test_load_state_dict_checks_everything_and_changes_nothing(corrupt, error, match):
    params, opt, sd = _adam_sd()
    corrupt(sd)
    before = snapshot(opt, params)
    lr = opt.lr
    with pytest.raises(error, match=match):
        opt.load_state_dict(sd)
    assert_same_snapshot(snapshot(opt, params), before)
    assert opt.lr == lr


def test_state_for_an_untied_copy_not_created_yet_is_adopted_when_it_appears():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, 2))
    zeros = g.constant(np.zeros(2))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(zeros, name="h")
        w = g.parameter("w", (2,), init="normal")  # untied: w@0, w@1, ...
        L.update(h, h + w * xt)
    loss = (L.final(h) ** 2).sum()

    def train(opt, T):
        cg = g.build({"x": np.ones((T, 2))}, loss)
        opt.zero_grad()
        cg.backward(loss)
        opt.step()

    opt = optim.Adam(g.params, lr=0.1)
    train(opt, 3)
    sd = opt.state_dict()
    assert set(sd["state"]) == {"w@0", "w@1", "w@2"}
    values = g.params.state_dict()
    train(opt, 3)
    expected = g.params.state_dict()

    g2 = vg.VirtualGraph(dtype=np.float64, seed=7)  # the same model, fresh: no untied copies yet
    g, g_old = g2, g
    x = g.input("x", (None, 2))
    zeros = g.constant(np.zeros(2))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(zeros, name="h")
        w = g.parameter("w", (2,), init="normal")
        L.update(h, h + w * xt)
    loss = (L.final(h) ** 2).sum()
    opt2 = optim.Adam(g.params, lr=0.1)
    opt2.load_state_dict(sd)  # state for w@0..2, which do not exist yet: kept for later
    assert opt2.state_dict()["state"].keys() == sd["state"].keys()
    g.load_state_dict(values)
    train(opt2, 3)
    for k, v in expected.items():
        np.testing.assert_array_equal(g.params[k].value, v)
    assert g_old is not g


def _untied_model(seed=0):
    """A loop whose body declares ``w`` (2,) untied (w@0, w@1, ... created by builds) and a shared
    ``v`` (2,)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed)
    x = g.input("x", (None, 2))
    zeros = g.constant(np.zeros(2))
    with g.loop() as L:
        xt = L.step(x)
        h = L.carry(zeros, name="h")
        w = g.parameter("w", (2,), init="normal")
        v = g.parameter("v", (2,), init="normal", share=True)
        L.update(h, h * v + w * xt)
    return g, (L.final(h) ** 2).sum(), w


def _trained_state(T=3):
    g, loss, _ = _untied_model()
    opt = optim.Adam(g.params, lr=0.1)
    cg = g.build({"x": np.ones((T, 2))}, loss)
    cg.backward(loss)
    opt.step()
    return opt.state_dict()


def _unchanged_after(opt, call, error, match):
    before = opt.state_dict()
    with pytest.raises(error, match=match):
        call()
    after = opt.state_dict()
    assert (
        after["hyperparameters"] == before["hyperparameters"]
        and after["state"].keys() == before["state"].keys()
    )
    for name, entry in before["state"].items():
        for k, v in entry.items():
            np.testing.assert_array_equal(after["state"][name][k], v)


def test_state_for_an_untied_copy_not_created_yet_is_checked_against_its_declaration():
    sd = _trained_state(T=3)
    sd["state"]["w@5"] = {"step": 1, "exp_avg": np.zeros(3), "exp_avg_sq": np.zeros(3)}  # w is (2,)
    g, loss, _ = _untied_model()  # fresh: no untied copy exists yet
    opt = optim.Adam(g.params, lr=0.1)
    _unchanged_after(opt, lambda: opt.load_state_dict(sd), vg.ShapeError,
                     r"'exp_avg' of parameter 'w@5' has shape \(3,\), its declaration gives .* shape \(2,\)")  # fmt: skip
    sd["state"]["w@5"] = {
        "step": 1,
        "exp_avg": np.zeros(2, np.float32),
        "exp_avg_sq": np.zeros(2, np.float32),
    }
    _unchanged_after(opt, lambda: opt.load_state_dict(sd), TypeError, "'w@5' has dtype float32")
    sd["state"]["w@5"] = {"step": 1, "exp_avg": np.zeros(2), "exp_avg_sq": np.zeros(2)}
    assert opt.load_state_dict(sd) == []
    assert set(opt.state_dict()["state"]) == {"w@0", "w@1", "w@2", "w@5", "v"}


@pytest.mark.parametrize("bind", ["store", "graph", "module-like", "virtual node"])
def test_state_for_names_never_declared_is_refused_unless_not_strict(bind):
    sd = _trained_state(T=2)
    entry = sd["state"]["w@0"]
    sd["state"]["ghost@3"] = entry  # no parameter "ghost"
    sd["state"]["w@1.2"] = entry  # w is in one loop: its copies have one index
    sd["state"]["v@4"] = entry  # v is shared: it has no copies
    g, loss, w = _untied_model()
    params = {"store": g.params, "graph": g, "virtual node": [w]}.get(bind)
    if params is None:

        class Model:  # anything with parameters(), graph and parameter_names(), as nn modules
            graph = g

            def parameters(self):
                return [g.params[k] for k in g.params if k.startswith("w@")]

            def parameter_names(self):
                return ["w"]

        params = Model()
    opt = optim.Adam(params, lr=0.1)
    cg = g.build({"x": np.ones((2, 2))}, loss)
    cg.backward(loss)
    opt.step()
    if bind in ("virtual node", "module-like"):
        del sd["state"]["v"]  # v is not one of this optimiser's parameters
    _unchanged_after(opt, lambda: opt.load_state_dict(sd), ValueError,
                     r"'ghost@3', 'w@1.2', 'v@4', which this optimiser does not update.*strict=False")  # fmt: skip
    ignored = opt.load_state_dict(sd, strict=False)
    assert ignored == ["ghost@3", "w@1.2", "v@4"]
    assert set(opt.state_dict()["state"]) == {"w@0", "w@1"} | ({"v"} if bind in ("store", "graph") else set())
    with pytest.raises(TypeError, match="strict must be True or False"):
        opt.load_state_dict(sd, strict="no")


def test_state_for_a_fixed_list_of_nodes_has_no_pending_copies():
    params, grads = make_params()
    opt = optim.Adam(params, lr=0.1)
    one_good_step(opt, params, grads[0])
    sd = opt.state_dict()
    sd["state"]["a@3"] = sd["state"]["a"]  # kept forever before: no list of nodes ever grows
    _unchanged_after(
        opt, lambda: opt.load_state_dict(sd), ValueError, "'a@3', which this optimiser does not update"
    )


def test_scheduler_state_dict_round_trip_and_checks():
    params, _ = make_params()
    opt = optim.SGD(params, lr=1.0)
    sched = optim.CosineAnnealingLR(opt, T_max=10, eta_min=0.1)
    for _ in range(4):
        sched.step()
    sd = sched.state_dict()
    assert sd == {
        "scheduler": "CosineAnnealingLR",
        "last_epoch": 4,
        "base_lr": 1.0,
        "T_max": 10,
        "eta_min": 0.1,
    }
    opt2 = optim.SGD(params, lr=1.0)
    sched2 = optim.CosineAnnealingLR(opt2, T_max=3)
    sched2.load_state_dict(sd)
    assert sched2.step() == sched.step()
    for bad, error in [({**sd, "scheduler": "StepLR"}, ValueError), ({**sd, "last_epoch": -1}, ValueError),
                       ({**sd, "T_max": "10"}, TypeError), ({**sd, "extra": 1}, ValueError)]:  # fmt: skip
        before = sched2.state_dict()
        with pytest.raises(error):
            sched2.load_state_dict(bad)
        assert sched2.state_dict() == before


def test_zero_d_arrays_are_accepted_as_numbers():
    params, _ = make_params()
    assert optim.SGD(params, lr=np.array(0.5)).lr == 0.5
    with pytest.raises(TypeError, match="lr"):
        optim.SGD(params, lr=np.array([0.5]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("cls", "wd"), [(optim.Adam, 0.0), (optim.Adam, 0.1), (optim.AdamW, 0.1)])
def test_adam_in_place_is_the_formula_bit_for_bit(dtype, cls, wd):
    """Adam works in place through a recycled scratch array; the result is the formula computed
    with fresh temporaries, in the same order, bit for bit — for parameters large enough that the
    scratch is recycled (one buffer shared by both), and the arrays a user read before a step keep
    their contents."""
    rng = np.random.default_rng(1)
    cg = vg.ComputeGraph(dtype)
    shapes = [(300, 200), (200, 300), (7,)]
    params = [cg.parameter(rng.standard_normal(s), name=f"p{i}") for i, s in enumerate(shapes)]
    lr, (b1, b2), eps = 0.01, (0.8, 0.95), 1e-6
    opt = cls(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = [np.array(p.value) for p in params]
    m = [np.zeros_like(r) for r in ref]
    v = [np.zeros_like(r) for r in ref]
    for t in range(1, 4):
        held = [p.value for p in params]
        copies = [np.array(h) for h in held]
        for i, p in enumerate(params):
            g = rng.standard_normal(p.shape).astype(dtype)
            p.grad = g
            if cls is optim.AdamW:
                ref[i] = ref[i] * (1.0 - lr * wd)
            else:
                g = g + wd * ref[i]
            m[i] = m[i] * b1 + (1.0 - b1) * g
            v[i] = v[i] * b2 + (1.0 - b2) * g * g
            denom = np.sqrt(v[i]) / math.sqrt(1.0 - b2**t) + eps
            ref[i] = ref[i] - (lr / (1.0 - b1**t)) * (m[i] / denom)
        opt.step()
        for i, p in enumerate(params):
            assert p.value.dtype == dtype
            np.testing.assert_array_equal(p.value, ref[i])
            np.testing.assert_array_equal(held[i], copies[i])


@pytest.mark.parametrize("keeps", ["array", "view"])
def test_a_custom_update_that_keeps_what_it_returns_has_it_copied(keeps):
    """An update whose result something else still refers to (the update keeps it, or it is a
    view of an array it keeps) is copied into the parameter, as ``p.value = x`` does: changing it
    later does not reach the parameter. (The built-in updates' new arrays are adopted: below.)"""
    (a, _), grads = make_params()
    kept = []

    class Keeper(optim.SGD):
        def _update(self, value, grad, state):
            new = super()._update(value, grad, state)
            if keeps == "view":
                kept.append(np.concatenate([new, new]))
                return kept[0][: len(new)]
            kept.append(new)
            return new

    a.grad = grads[0][0]
    Keeper([a], lr=0.1).step()
    expected = np.array(a.value)
    np.testing.assert_array_equal(expected, kept[0][: len(expected)])
    kept[0][...] = 0.0
    np.testing.assert_array_equal(a.value, expected)


def test_the_built_in_update_is_adopted_without_a_copy():
    (a, _), grads = make_params()
    made = []

    class Spy(optim.SGD):
        def _update(self, value, grad, state):
            new = super()._update(value, grad, state)
            made.append(new.__array_interface__["data"][0])  # its address only: holding it would share it
            return new

    a.grad = grads[0][0]
    Spy([a], lr=0.1).step()
    assert a.value.__array_interface__["data"][0] == made[0]
