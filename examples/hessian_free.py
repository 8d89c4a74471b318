"""Hessian-free optimisation of an RNN on the addition problem, against Adam on the same budget.

Martens and Sutskever (ICML 2011) trained plain tanh RNNs on long-range "pathological" tasks with
Hessian-free optimisation (truncated Newton): each step solves ``(G + lambda I) d = -grad`` by a
few iterations of conjugate gradient, ``G`` the Gauss-Newton matrix, which CG only ever multiplies
by a vector. vgraph gives that product through the unrolled loop — second-order backpropagation
through time: ``vg.higher.GaussNewtonVectorProduct`` records the gradient of the loop as graph nodes
(``create_graph=True``) and differentiates it again (see docs/second_order.md).

The addition problem (Hochreiter & Schmidhuber, 1997): a sequence of ``(value, marker)`` pairs,
values uniform in [0, 1], two markers set (one in the first half, one in the second); the target
is the sum of the two marked values. Always predicting 1.0 gives an MSE of 1/6 ~ 0.167.

The model, in plain Python::

    h = 0
    for x_t in x:                                   # x: (time, batch, 2)
        h = tanh(x_t @ W_x + h @ W_h + b)
    loss = mean((h @ W_o + b_o - y) ** 2)

Hessian-free, per step: the gradient on a batch; CG on ``(G + lambda I) d = -grad`` started from
the previous step's direction (times 0.95), stopped by Martens' relative-progress rule or after
``--cg-iters`` products; the step (halved up to three times) taken if the loss drops on that batch;
``lambda`` adjusted by the Levenberg-Marquardt rule (the reduction ratio of the loss to CG's
quadratic model). Adam: the
same model from the same initial weights, one batch per step, gradient norm clipped to 1. Both
get the same wall-clock budget (``--seconds`` each; or fixed step counts, ``--hf-steps`` and
``--adam-steps``), and both curves (held-out MSE against time) are printed and plotted
(``out/hessian_free.png``, if matplotlib is installed).

Run: ``python examples/hessian_free.py`` (``--help`` for options; the defaults take a few minutes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

import vgraph as vg
from vgraph import losses, optim
from vgraph.higher import GaussNewtonVectorProduct
from vgraph.tbptt import Progress

BASELINE = 1.0 / 6.0  # MSE of always predicting 1.0


def adding_batch(rng: np.random.Generator, batch: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """``batch`` addition-problem sequences: inputs (steps, batch, 2) and targets (batch, 1)."""
    values = rng.random((steps, batch))
    markers = np.zeros((steps, batch))
    half = max(1, steps // 2)
    first = rng.integers(0, half, size=batch)
    second = rng.integers(half, steps, size=batch)
    cols = np.arange(batch)
    markers[first, cols] = 1.0
    markers[second, cols] = 1.0
    return np.stack([values, markers], axis=-1), (values[first, cols] + values[second, cols])[:, None]


def build_model(hidden: int, seed: int) -> tuple[vg.VirtualGraph, vg.VirtualNode, vg.VirtualNode]:
    """The tanh RNN regressor: the graph, its loss and its output (in float64)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=seed, name="rnn-addition")
    x = g.input("x", shape=(None, None, 2))
    y = g.input("y", shape=(None, 1))
    h0 = g.input("h0", shape=(None, hidden))
    W_x = g.parameter("W_x", (2, hidden), init=vg.nn.init.normal(0.5))
    W_h = g.parameter("W_h", (hidden, hidden), init=vg.nn.init.normal(1.0 / np.sqrt(hidden)))
    b = g.parameter("b", (hidden,), init=vg.nn.init.zeros())
    W_o = g.parameter("W_o", (hidden, 1), init=vg.nn.init.normal(0.1))
    b_o = g.parameter("b_o", (1,), init=vg.nn.init.constant(1.0))
    with g.loop(name="time") as loop:
        h = loop.carry(h0, name="h")
        loop.update(h, vg.tanh(loop.step(x, name="x_t") @ W_x + h @ W_h + b))
    out = loop.final(h, name="h_T") @ W_o + b_o
    return g, losses.mse_loss(out, y), out


def _dot(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return float(sum(np.vdot(x, y) for x, y in zip(a, b)))


def _axpy(alpha: float, x: Sequence[np.ndarray], y: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [alpha * a + b for a, b in zip(x, y)]


def conjugate_gradient(
    apply: Callable[[list[np.ndarray]], list[np.ndarray]],
    b: list[np.ndarray],
    x0: list[np.ndarray],
    max_iters: int,
) -> tuple[list[np.ndarray], int]:
    """Minimise ``q(x) = x.A x / 2 - b.x`` (``A`` positive definite, given by ``apply``) by conjugate
    gradient from ``x0``, stopping on Martens' relative-progress rule (``q`` improved by less than
    5e-4 of its value per iteration over the last tenth of the iterations) or after
    ``max_iters`` products. Returns the solution and the number of products."""
    x = x0
    Ax = apply(x)
    r = [bi - ai for bi, ai in zip(b, Ax)]
    p = [ri.copy() for ri in r]
    rr = _dot(r, r)
    qs = [0.5 * _dot(x, Ax) - _dot(b, x)]
    products = 1
    for i in range(1, max_iters + 1):
        Ap = apply(p)
        products += 1
        pAp = _dot(p, Ap)
        if pAp <= 0:
            break
        alpha = rr / pAp
        x = _axpy(alpha, p, x)
        r = _axpy(-alpha, Ap, r)
        rr_new = _dot(r, r)
        p = _axpy(rr_new / rr, p, r)
        rr = rr_new
        q = -0.5 * (_dot(x, b) + _dot(x, r))  # = x.A x / 2 - b.x, since A x = b - r
        qs.append(q)
        k = max(10, i // 10)
        if i > k and q < 0 and (q - qs[-1 - k]) / q < k * 5e-4:
            break
    return x, products


def evaluate(g: vg.VirtualGraph, loss: vg.VirtualNode, x: np.ndarray, y: np.ndarray, hidden: int) -> float:
    """MSE on a held-out set."""
    g.eval()
    try:
        cg = g.build({"x": x, "y": y, "h0": np.zeros((x.shape[1], hidden))}, loss)
        return float(cg.forward())
    finally:
        g.train()


def train_hf(args: argparse.Namespace, test: tuple[np.ndarray, np.ndarray]) -> list[tuple[float, float]]:
    """Hessian-free training; the curve ``[(seconds, held-out MSE)]``."""
    g, loss, out = build_model(args.hidden, args.seed)
    params = g.params.parameters()
    rng = np.random.default_rng(args.seed + 1)
    lam = args.damping
    direction = [np.zeros(p.shape) for p in params]
    curve = [(0.0, evaluate(g, loss, *test, args.hidden))]
    start = time.perf_counter()
    step = 0
    progress = Progress(args.hf_steps or None, desc="Hessian-free", mode=args.progress, every=10)
    while step < args.hf_steps if args.hf_steps else time.perf_counter() - start < args.seconds:
        step += 1
        x, y = adding_batch(rng, args.hf_batch, args.seq)
        cg = g.build({"x": x, "y": y, "h0": np.zeros((args.hf_batch, args.hidden))}, loss, programs=False)
        loss_node, out_node = cg.node(loss), cg.node(out)
        f0 = float(loss_node.value)
        grad = cg.grad(loss_node, params, retain_graph=True)
        G = GaussNewtonVectorProduct(loss_node, out_node, params)

        def damped(
            v: list[np.ndarray], G: GaussNewtonVectorProduct = G, lam: float = lam
        ) -> list[np.ndarray]:
            return [gv + lam * vi for gv, vi in zip(G(v), v)]

        direction, _ = conjugate_gradient(
            damped, [-a for a in grad], [0.95 * d for d in direction], args.cg_iters
        )
        Gd = G(direction)
        model_change = _dot(grad, direction) + 0.5 * _dot(direction, Gd)  # CG's quadratic model
        old = [p.value.copy() for p in params]
        f1 = f0
        for rate in (1.0, 0.5, 0.25, 0.125):  # a backtracking line search along the direction
            for p, o, d in zip(params, old, direction):
                p.value = o + rate * d
            f1 = float(cg.forward(loss_node))
            if rate == 1.0:
                rho = (f1 - f0) / model_change if model_change < 0 else -1.0
                if rho < 0.25:
                    lam *= 1.5
                elif rho > 0.75:
                    lam *= 2.0 / 3.0
            if f1 < f0:
                break
        if f1 >= f0:  # no progress on this batch: keep the old weights, restart CG from zero
            for p, o in zip(params, old):
                p.value = o
            direction = [np.zeros(p.shape) for p in params]
        curve.append((time.perf_counter() - start, evaluate(g, loss, *test, args.hidden)))
        progress.update(**{"batch loss": min(f0, f1), "lambda": lam, "held-out MSE": curve[-1][1]})
    progress.close()
    return curve


def train_adam(args: argparse.Namespace, test: tuple[np.ndarray, np.ndarray]) -> list[tuple[float, float]]:
    """Adam on the same model and initial weights; the curve ``[(seconds, held-out MSE)]``."""
    g, loss, _ = build_model(args.hidden, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed + 2)
    h0 = np.zeros((args.batch, args.hidden))
    curve = [(0.0, evaluate(g, loss, *test, args.hidden))]
    start = time.perf_counter()
    step = 0
    every = max(1, args.hf_batch // args.batch)  # evaluated about as often per sequence seen as HF
    progress = Progress(args.adam_steps or None, desc="Adam", mode=args.progress, every=100)
    while step < args.adam_steps if args.adam_steps else time.perf_counter() - start < args.seconds:
        step += 1
        x, y = adding_batch(rng, args.batch, args.seq)
        cg = g.build({"x": x, "y": y, "h0": h0}, loss)
        batch_loss = cg.backward(loss)
        optim.clip_grad_norm_(g.params, 1.0)
        opt.step()
        opt.zero_grad()
        if step % every == 0:
            curve.append((time.perf_counter() - start, evaluate(g, loss, *test, args.hidden)))
        progress.update(**{"batch loss": batch_loss, "held-out MSE": curve[-1][1]})
    progress.close()
    if curve[-1][0] < time.perf_counter() - start:
        curve.append((time.perf_counter() - start, evaluate(g, loss, *test, args.hidden)))
    return curve


def plot(curves: dict[str, list[tuple[float, float]]], path: Path, title: str) -> bool:
    """The learning curves as a PNG (``False`` without matplotlib)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot([t for t, _ in curve], [m for _, m in curve], label=name)
    ax.axhline(BASELINE, color="grey", linestyle="--", label="predict 1.0")
    ax.set_yscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("held-out MSE")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=100, help="sequence length T")
    parser.add_argument("--hidden", type=int, default=16, help="hidden units")
    parser.add_argument("--seconds", type=float, default=120.0, help="wall-clock budget of each method")
    parser.add_argument("--hf-steps", type=int, default=0, help="fixed HF steps instead of --seconds")
    parser.add_argument("--adam-steps", type=int, default=0, help="fixed Adam steps instead of --seconds")
    parser.add_argument("--hf-batch", type=int, default=256, help="sequences per HF step")
    parser.add_argument("--cg-iters", type=int, default=30, help="most Gauss-Newton products per HF step")
    parser.add_argument("--damping", type=float, default=1.0, help="initial lambda")
    parser.add_argument("--batch", type=int, default=32, help="sequences per Adam step")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data")
    parser.add_argument("--out", default="out", help="where the plot goes")
    Progress.add_option(parser)
    args = parser.parse_args(argv)

    test = adding_batch(np.random.default_rng(args.seed + 1000), 512, args.seq)
    print(f"Addition problem, T = {args.seq}: tanh RNN with {args.hidden} hidden units (float64)")
    print(f"Baseline (always predict 1.0): MSE {BASELINE:.3f}")
    hf = train_hf(args, test)
    adam = train_adam(args, test)
    for name, curve in (("Hessian-free", hf), ("Adam", adam)):
        print(
            f"  {name:12s} held-out MSE {curve[0][1]:.3g} -> {curve[-1][1]:.3g} in {curve[-1][0]:.1f} s "
            f"({len(curve) - 1} evaluations)"
        )
    solved = {name: curve[-1][1] < 0.1 * BASELINE for name, curve in (("Hessian-free", hf), ("Adam", adam))}
    verdict = ", ".join(f"{n} {'solved it' if s else 'did not solve it'}" for n, s in solved.items())
    print(f"(solved: held-out MSE below a tenth of the baseline) {verdict}")
    path = Path(args.out) / "hessian_free.png"
    if plot({"Hessian-free": hf, "Adam": adam}, path, f"addition problem, T = {args.seq}"):
        print(f"learning curves: {path}")
    return {"hf": hf, "adam": adam, "baseline": BASELINE, "solved": solved}


if __name__ == "__main__":
    main()
