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
