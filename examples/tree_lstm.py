"""A binary Tree-LSTM learns to evaluate arithmetic expressions mod 10; a bag of tokens cannot.

The data are random expression trees over the digits 0-9 with the operators +, - and x, such as
``((3 - 7) x (4 + 9))``; the label of every node (leaf or operator) is its value mod 10, so it
depends on the tree's structure: ``(3 - 7) x 4`` and ``3 - (7 x 4)`` have the same tokens and
different values. Trees are generated on the fly, so training never sees a tree twice.

The model is the N-ary (here binary) Tree-LSTM of Tai, Socher and Manning (2015), declared once
with ``g.recurse``: a loop over the tree's nodes, children first, where a node reads its children's
``h`` and ``c`` by index. Each build takes a *forest*, a batch of trees with their nodes in one
children-first array (any concatenation of post-orders is one), and every node's state is
classified, as in the Stanford Sentiment Treebank. The baseline sees each subtree as a bag of its
tokens (digits and operators, order and structure dropped) — the same supervision, embeddings of
the same size, an MLP instead of the tree.

It prints progress, checks the quality bar (accuracy of the whole expression's value on held-out
trees, against chance, the majority class and the baseline), shows a few predictions, and renders
the unrolled Tree-LSTM of one small tree (``out/tree_lstm_unrolled.svg``).

Run: ``python examples/tree_lstm.py`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress

OPS = ("+", "-", "x")
DIGITS = 10
VOCAB = DIGITS + len(OPS)  # tokens: 0-9 the digits, 10 + k the operator OPS[k]
QUALITY_BAR = 0.6  # accuracy of the root's value on held-out trees, at the default settings


# ---------------------------------------------------------------------------- data


@dataclass
class Forest:
    """A batch of expression trees as one children-first node array.

    Attributes:
        children: ``(N, 2)`` child indices into the forest (``-1``: a leaf has none).
        tokens: ``(N,)`` token of each node (a digit, or ``DIGITS + k`` for operator ``OPS[k]``).
        labels: ``(N,)`` the value of each node's subtree, mod ``modulus``.
        roots: ``(B,)`` index of each tree's root (its last node).
        bags: ``(N, VOCAB)`` token counts of each node's subtree (the baseline's input).
    """

    children: np.ndarray
    tokens: np.ndarray
    labels: np.ndarray
    roots: np.ndarray
    bags: np.ndarray


def random_tree(
    rng: np.random.Generator, n_leaves: int, modulus: int
) -> tuple[list[list[int]], list[int], list[int]]:
    """A random expression over ``n_leaves`` digits, children first: (children, tokens, values).

    Start from a row of digits and merge two neighbours under a random operator until one tree is
    left, then number the nodes in post-order (children first, the root last).
    """
    children = [[-1, -1] for _ in range(n_leaves)]
    tokens = [int(d) for d in rng.integers(0, DIGITS, n_leaves)]
    values = [t % modulus for t in tokens]
    row = list(range(n_leaves))
    while len(row) > 1:
        k = int(rng.integers(0, len(row) - 1))
        a, b = row[k], row[k + 1]
        op = int(rng.integers(0, len(OPS)))
        va, vb = values[a], values[b]
        value = (va + vb, va - vb, va * vb)[op] % modulus
        children.append([a, b])
        tokens.append(DIGITS + op)
        values.append(value)
        row[k : k + 2] = [len(tokens) - 1]
    return postorder(children, tokens, values)


def postorder(children: list[list[int]], tokens: list[int], values: list[int]) -> tuple[list, list, list]:
    """The same tree renumbered in post-order (left subtree, right subtree, node: the order the
    expression is written in, operators after their operands), without recursion."""
    order: list[int] = []
    stack = [(len(tokens) - 1, False)]
    while stack:
        t, expanded = stack.pop()
        a, b = children[t]
        if expanded or a < 0:
            order.append(t)
        else:
            stack.extend([(t, True), (b, False), (a, False)])
    new = {old: i for i, old in enumerate(order)}
    kids = [[new[a], new[b]] if a >= 0 else [-1, -1] for a, b in (children[t] for t in order)]
    return kids, [tokens[t] for t in order], [values[t] for t in order]


def make_forest(rng: np.random.Generator, n_trees: int, leaves: tuple[int, int], modulus: int) -> Forest:
    """``n_trees`` random trees with ``leaves[0]..leaves[1]`` digits each, as one :class:`Forest`."""
    kids: list[list[int]] = []
    toks: list[int] = []
    vals: list[int] = []
    roots = []
    for _ in range(n_trees):
        c, t, v = random_tree(rng, int(rng.integers(leaves[0], leaves[1] + 1)), modulus)
        off = len(toks)
        kids.extend([a + off if a >= 0 else -1, b + off if b >= 0 else -1] for a, b in c)
        toks.extend(t)
        vals.extend(v)
        roots.append(len(toks) - 1)
    children = np.array(kids, dtype=np.int64)
    tokens = np.array(toks, dtype=np.int64)
    bags = np.zeros((len(toks), VOCAB), dtype=np.float32)
    bags[np.arange(len(toks)), tokens] = 1.0
    for t, (a, b) in enumerate(children):  # children first: their bags are complete
        if a >= 0:
            bags[t] += bags[a] + bags[b]
    return Forest(children, tokens, np.array(vals, dtype=np.int64), np.array(roots), bags)


def expression(forest: Forest, i: int) -> str:
    """The text of tree ``i`` of the forest, e.g. ``(3 - 7) x 4``, built without recursion."""
    first = int(forest.roots[i - 1]) + 1 if i > 0 else 0  # a tree's nodes are contiguous
    root = int(forest.roots[i])
    text: dict[int, str] = {}
    for t in range(first, root + 1):
        a, b = forest.children[t]
        tok = int(forest.tokens[t])
        text[t] = str(tok) if a < 0 else f"({text[a]} {OPS[tok - DIGITS]} {text[b]})"
    whole = text[root]
    return whole[1:-1] if whole.startswith("(") else whole


# ---------------------------------------------------------------------------- models


def tree_lstm(
    dim: int, hidden: int, modulus: int, seed: int
) -> tuple[vg.VirtualGraph, dict[str, vg.VirtualNode]]:
    """The binary Tree-LSTM classifier of every node, as a virtual graph.

    At node t with token embedding x and children (h_L, c_L), (h_R, c_R) — zeros for a leaf —
    Tai et al.'s N-ary Tree-LSTM (N = 2), with a forget gate per child::

        [i, f_L, f_R, o, u] = x W + [h_L, h_R] U + b      (five blocks of H columns)
        c = σ(i) u' + σ(f_L) c_L + σ(f_R) c_R,   u' = tanh(u)
        h = σ(o) tanh(c)

    and ``logits_t = h_t W_out + b_out``. ``x W + b`` does not read the children: vgraph hoists it
    out of the recursion (one product for all nodes). Inputs: ``children``, ``tokens``,
    ``labels``; outputs: ``loss`` (mean cross-entropy over every node) and ``logits`` (N, modulus).
    """
    H = hidden
    g = vg.VirtualGraph(dtype=np.float32, seed=seed, name="binary Tree-LSTM")
    children = g.input("children", (None, 2))
    tokens = g.input("tokens", (None,))
    labels = g.input("labels", (None,))
    emb = nn.Embedding(g, VOCAB, dim, "emb", init=nn.normal(0.5))
    W = g.parameter("W", (dim, 5 * H))
    U = g.parameter("U", (2 * H, 5 * H))
    bias = np.zeros(5 * H)
    bias[H : 3 * H] = 1.0  # forget gates start open (Jozefowicz et al., 2015)
    b = g.parameter("b", init=bias)
    head = nn.Linear(g, H, modulus, "head")
    zeros = np.zeros(H)
    with g.recurse(children, name="tree") as r:
        xw = emb(r.step(tokens, name="token")) @ W + b
        h, c = r.state(zeros, name="h"), r.state(zeros, name="c")
        z = xw + vg.concat([r.child(h, 0), r.child(h, 1)], axis=0) @ U
        gates = vg.sigmoid(z[: 4 * H])
        u = vg.tanh(z[4 * H :])
        c_new = gates[:H] * u + gates[H : 2 * H] * r.child(c, 0) + gates[2 * H : 3 * H] * r.child(c, 1)
        h_new = gates[3 * H :] * vg.tanh(c_new)
        r.update(h, h_new)
        r.update(c, c_new)
    logits = head(r.stack(h_new, name="h_all"))
    return g, {"loss": losses.cross_entropy(logits, labels), "logits": logits}


def bag_of_tokens(
    dim: int, hidden: int, modulus: int, seed: int
) -> tuple[vg.VirtualGraph, dict[str, vg.VirtualNode]]:
    """The baseline: each subtree's token counts times the embeddings, then an MLP.

    ``logits = tanh(bag E W_1 + b_1) W_2 + b_2``. It knows which digits and operators a subtree
    has, not how they are arranged. Inputs: ``bags`` (N, VOCAB), ``labels``; outputs as
    :func:`tree_lstm`.
    """
    g = vg.VirtualGraph(dtype=np.float32, seed=seed, name="bag of tokens")
    bags = g.input("bags", (None, VOCAB))
    labels = g.input("labels", (None,))
    E = g.parameter("E", (VOCAB, dim), init=nn.normal(0.5))
    hidden_layer = nn.Linear(g, dim, hidden, "hidden")
    head = nn.Linear(g, hidden, modulus, "head")
    logits = head(vg.tanh(hidden_layer(bags @ E)))
    return g, {"loss": losses.cross_entropy(logits, labels), "logits": logits}


def tree_feed(f: Forest) -> dict[str, np.ndarray]:
    return {"children": f.children, "tokens": f.tokens, "labels": f.labels}


def bag_feed(f: Forest) -> dict[str, np.ndarray]:
    return {"bags": f.bags, "labels": f.labels}


# ---------------------------------------------------------------------------- training


def train(
    name: str,
    g: vg.VirtualGraph,
    outs: dict,
    feed_of,
    forests: list[Forest],
    lr: float,
    progress_mode: str,
) -> tuple[list[float], float]:
    """One Adam step per forest; returns the running losses at report steps and the seconds."""
    opt = optim.Adam(g.params, lr=lr)
    history: list[float] = []
    running = None
    every = max(1, len(forests) // 10)
    start = time.perf_counter()
    with Progress(len(forests), desc=name, mode=progress_mode, every=every) as progress:
        for step, forest in enumerate(forests, start=1):
            cg = g.build(feed_of(forest), outs["loss"])
            loss = cg.backward(outs["loss"])
            optim.clip_grad_norm_(g.params, 5.0)
            opt.step()
            opt.zero_grad()
            del cg
            running = loss if running is None else 0.95 * running + 0.05 * loss
            report = step % every == 0 or step == len(forests)
            if report:
                history.append(running)
            progress.update(log=report, loss=running)
    return history, time.perf_counter() - start


def predict_roots(g: vg.VirtualGraph, outs: dict, feed_of, forest: Forest) -> np.ndarray:
    """The predicted value of every tree's root (evaluation mode)."""
    g.eval()
    try:
        logits = g.build(feed_of(forest), outs["logits"]).forward()
    finally:
        g.train()
    return np.asarray(logits)[forest.roots].argmax(axis=-1)


def render_tree(g: vg.VirtualGraph, outs: dict, path: Path) -> None:
    """Render the unrolled Tree-LSTM of one small tree to ``path`` (SVG)."""
    from vgraph import render

    forest = make_forest(np.random.default_rng(7), 1, (3, 3), 10)
    cg = g.build(tree_feed(forest), outs["loss"])
    render.render(cg, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=700, help="training steps (one forest each)")
    parser.add_argument("--batch", type=int, default=16, help="trees per forest (per step)")
    parser.add_argument("--min-leaves", type=int, default=2, help="fewest digits in a tree")
    parser.add_argument("--max-leaves", type=int, default=5, help="most digits in a tree")
    parser.add_argument("--modulus", type=int, default=10, help="values are taken mod this (classes)")
    parser.add_argument("--dim", type=int, default=32, help="token embedding size")
    parser.add_argument("--hidden", type=int, default=32, help="Tree-LSTM (and baseline MLP) hidden units")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--test", type=int, default=400, help="held-out trees to evaluate on")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters and of the data")
    Progress.add_option(parser)
    parser.add_argument("--out", type=Path, default=Path("out"), help="where the picture goes")
    parser.add_argument("--no-render", action="store_true", help="skip the picture")
    args = parser.parse_args(argv)
    if not 1 <= args.min_leaves <= args.max_leaves:
        parser.error("need 1 <= --min-leaves <= --max-leaves")
    if args.modulus < 2:
        parser.error("--modulus must be at least 2")

    leaves = (args.min_leaves, args.max_leaves)
    rng = np.random.default_rng(args.seed)
    forests = [make_forest(rng, args.batch, leaves, args.modulus) for _ in range(args.steps)]
    test = make_forest(np.random.default_rng(args.seed + 10_000), args.test, leaves, args.modulus)
    y = test.labels[test.roots]
    majority = float(np.mean(y == np.bincount(y, minlength=args.modulus).argmax()))
    print(
        f"Expressions over {leaves[0]}-{leaves[1]} digits with {', '.join(OPS)}, values mod {args.modulus}; "
        f"{args.steps} steps of {args.batch} trees ({sum(len(f.tokens) for f in forests):,} nodes in all)"
    )

    results = {}
    for name, make, feed_of in (("tree-lstm", tree_lstm, tree_feed), ("bag", bag_of_tokens, bag_feed)):
        g, outs = make(args.dim, args.hidden, args.modulus, args.seed)
        history, seconds = train(name, g, outs, feed_of, forests, args.lr, args.progress)
        pred = predict_roots(g, outs, feed_of, test)
        results[name] = (g, outs, history, seconds, pred, float(np.mean(pred == y)))
        print(
            f"{name}: trained in {seconds:.1f}s ({args.steps * args.batch / seconds:,.0f} trees/s), "
            f"held-out accuracy of the whole expression {results[name][5]:.3f}"
        )

    tree_acc, bag_acc = results["tree-lstm"][5], results["bag"][5]
    passed = tree_acc >= QUALITY_BAR and tree_acc > bag_acc + 0.2
    print(
        f"\nValue of the whole expression, {args.test} held-out trees: Tree-LSTM {tree_acc:.3f}, "
        f"bag of tokens {bag_acc:.3f}, majority class {majority:.3f}, chance {1 / args.modulus:.3f}; "
        f"quality bar (>= {QUALITY_BAR} and 0.2 above the bag): {'reached' if passed else 'NOT reached'}"
    )
    pred_tree, pred_bag = results["tree-lstm"][4], results["bag"][4]
    print(f"\nSome held-out trees (value mod {args.modulus}: truth / Tree-LSTM / bag):")
    for i in range(min(6, args.test)):
        print(f"  {expression(test, i):32} {y[i]} / {pred_tree[i]} / {pred_bag[i]}")

    if not args.no_render:
        args.out.mkdir(parents=True, exist_ok=True)
        g, outs = results["tree-lstm"][:2]
        try:
            render_tree(g, outs, args.out / "tree_lstm_unrolled.svg")
            print(f"\nThe unrolled Tree-LSTM of one tree: {args.out / 'tree_lstm_unrolled.svg'}")
        except vg.RenderError as e:
            print(f"Could not render the unrolled tree: {e}", file=sys.stderr)
    tree_history = results["tree-lstm"][2]
    return {
        "tree_accuracy": tree_acc,
        "bag_accuracy": bag_acc,
        "majority_accuracy": majority,
        "chance": 1 / args.modulus,
        "first_loss": tree_history[0],
        "final_loss": tree_history[-1],
        "tree_seconds": results["tree-lstm"][3],
        "bag_seconds": results["bag"][3],
        "passed": passed,
    }


if __name__ == "__main__":
    main()
