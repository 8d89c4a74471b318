"""Recursion over trees and DAGs (issue 11): ``g.recurse(children)``.

Values and gradients against a hand-written recursive numpy reference (float64, 1e-12),
gradcheck on small trees and on a DAG (a node with two parents), random trees with hypothesis,
keys by structure node, multi-output branches for leaves vs inner nodes, hoisting of
child-independent work, structure guards, and every bad structure a typed error.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vgraph as vg

D, H = 3, 4


def tree_rnn(share=None):
    """h(node) = tanh(x_node @ W + h(left) @ U_l + h(right) @ U_r + b); loss = sum(h(root)^2)."""
    g = vg.VirtualGraph(dtype=np.float64, seed=2)
    children = g.input("children", (None, 2))
    xs = g.input("xs", (None, D))
    with g.recurse(children, name="tree") as r:
        W = g.parameter("W", (D, H), share=share)
        U_l = g.parameter("U_l", (H, H))
        U_r = g.parameter("U_r", (H, H))
        b = g.parameter("b", (H,), init=vg.nn.init.normal(0.3))
        x = r.step(xs, name="x")
        h = r.state(np.zeros(H), name="h")
        h_new = vg.tanh(x @ W + r.child(h, 0) @ U_l + r.child(h, 1) @ U_r + b)
        r.update(h, h_new)
    root = r.final(h)
    loss = vg.sum(root**2) + 0.1 * vg.sum(r.stack(h_new))
    return g, loss, r, h_new


def reference(children, xs, P):
    """Recursive numpy: the value at each node from its children's, then the loss and its
    gradient by hand (reverse order over the nodes, accumulating into children)."""
    N = len(children)
    h = [None] * N

    def value(t):  # plain recursion, as a user would write it (the trees here are small)
        if h[t] is None:
            kids = [value(c) if c >= 0 else np.zeros(H) for c in children[t]]
            h[t] = np.tanh(xs[t] @ P["W"] + kids[0] @ P["U_l"] + kids[1] @ P["U_r"] + P["b"])
        return h[t]

    for t in range(N):
        value(t)
    loss = np.sum(h[N - 1] ** 2) + 0.1 * sum(v.sum() for v in h)
    dh = [0.1 * np.ones(H) for _ in range(N)]
    dh[N - 1] = dh[N - 1] + 2 * h[N - 1]
    G = {k: np.zeros_like(v) for k, v in P.items()}
    for t in reversed(range(N)):
        da = dh[t] * (1 - h[t] ** 2)
        G["W"] += np.outer(xs[t], da)
        G["b"] += da
        for j, U in enumerate(("U_l", "U_r")):
            c = children[t][j]
            kid = h[c] if c >= 0 else np.zeros(H)
            G[U] += np.outer(kid, da)
            if c >= 0:
                dh[c] = dh[c] + P[U] @ da
    return loss, G, h


def random_tree(rng, leaves):
    """A random binary tree over ``leaves`` leaves, children before parents."""
    children = [[-1, -1] for _ in range(leaves)]
    pool = list(range(leaves))
    while len(pool) > 1:
        i, j = sorted(rng.choice(len(pool), 2, replace=False))
        a, b = pool[i], pool[j]
        children.append([a, b])
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [len(children) - 1]
    return np.array(children)


def check_against_reference(children, seed=0, hoist=True):
    g, loss, r, h_new = tree_rnn()
    xs = np.random.default_rng(seed).normal(size=(len(children), D))
    cg = g.build({"children": children, "xs": xs}, loss, hoist=hoist)
    value = cg.backward(loss)
    P = {k: g.params[k].value for k in g.params}
    ref_loss, G, h = reference(children.tolist(), xs, P)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-12)
    for k in G:
        np.testing.assert_allclose(g.params[k].grad, G[k], rtol=1e-12, atol=1e-13, err_msg=k)
    for t in range(len(children)):  # every node's value, reachable by structure node index
        # (atol: a value near 0 after cancellation, summed in another order by the grouped
        # product, differs from the reference's by an ulp of its terms, ~1e-16)
        np.testing.assert_allclose(cg.node(h_new, (t,)).value, h[t], rtol=1e-12, atol=1e-14)
    return g, cg, h_new


@pytest.mark.parametrize("programs", [True, False])
def test_a_small_tree_matches_the_recursive_reference(programs):
    #        4
    #      /   \
    #     2     3
    #    / \   /
    #   0   1 -
    children = np.array([[-1, -1], [-1, -1], [0, 1], [-1, -1], [2, 3]])
    with vg.body_programs(programs):
        g, cg, h_new = check_against_reference(children)
    assert cg.trip_count(next(v for v in g.nodes if v.kind == "loop")) == 5
    tanh = cg.node(h_new, (4,))
    assert str(tanh.key) == f"Tanh:{h_new.id}@4"  # <Tanh:k@4>: the tanh at structure node 4
    if programs:
        return
    # the child read at node 4, slot 0 *is* node 2's value: node 4 multiplies it by U_l directly
    left = cg.node(h_new, (2,))
    # (the product is computed by the sum that reads it, see vgraph.virtual.hoist.RowSum)
    (use,) = [
        n for n in cg.nodes() if n.key.idx == (4,) and left in n.parents and not cg.computed_when_read(n)
    ]
    assert use.op.name == "MatMulAddRow" and use.parents[:2] == (left, g.params["U_l"])


def test_a_dag_node_with_two_parents_gets_both_gradients():
    # node 2 is read by nodes 3 and 4; node 5 reads 3 and 4
    children = np.array([[-1, -1], [-1, -1], [0, 1], [2, -1], [-1, 2], [3, 4]])
    check_against_reference(children)
    g, loss, _, _ = tree_rnn()
    cg = g.build({"children": children, "xs": np.random.default_rng(1).normal(size=(6, D))}, loss)
    vg.gradcheck(cg.outputs[0], list(g.params.values()))


def test_one_node_tree_uses_the_defaults():
    check_against_reference(np.array([[-1, -1]]))


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.integers(1, 12), st.integers(0, 10_000), st.booleans())
def test_random_trees_match_the_reference(leaves, seed, hoist):
    children = random_tree(np.random.default_rng(seed), leaves)
    check_against_reference(children, seed=seed, hoist=hoist)


def test_parameters_in_a_recursion_body_are_tied_by_default():
    g, loss, _, _ = tree_rnn()
    assert sorted(g.params) == ["U_l", "U_r", "W", "b"]
    g2, loss2, _, _ = tree_rnn(share=False)
    g2.build({"children": np.array([[-1, -1], [-1, 0]]), "xs": np.ones((2, D))}, loss2)
    assert sorted(k for k in g2.params if k.startswith("W")) == ["W@0", "W@1"]


@pytest.mark.usefixtures("per_node")  # the per-node path's nodes and hoisting
def test_child_independent_work_is_hoisted_and_identical():
    children = random_tree(np.random.default_rng(3), 7)
    g, cg, _ = check_against_reference(children, hoist=True)
    assert any(k.type == "MatMul*" for k in cg._nodes)  # x @ W for every node at once


def test_changed_structure_is_refused_on_reforward():
    g, loss, _, _ = tree_rnn()
    children = np.array([[-1, -1], [-1, -1], [0, 1]])
    cg = g.build({"children": children, "xs": np.ones((3, D))}, loss)
    cg.feed({"children": np.array([[-1, -1], [-1, -1], [1, 0]])})
    with pytest.raises(vg.StructureChangedError, match="children array changed"):
        cg.forward()
    cg.feed({"children": children})
    cg.forward()
    cg.backward(loss)


@pytest.mark.parametrize(
    "children, message",
    [
        (
            np.array([[-1, -1], [0, 2], [0, 1]]),
            r"structure node 1 has child 2 \(slot 1\), which does not come before it",
        ),
        (
            np.array([[-1, -1], [1, -1]]),
            r"structure node 1 has child 1 \(slot 0\), which does not come before it",
        ),
        (np.array([[-1, -1], [0, 5]]), r"structure node 1 has child 5 \(slot 1\), out of range"),
        (np.array([[-1, -1], [0, -2]]), r"child -2 \(slot 1\), out of range"),
        (np.zeros((0, 2), dtype=int), "is empty"),
        (np.array([[-1.0, -1.0]]), "integer array"),
    ],
)
def test_bad_structures_are_typed_errors_naming_node_and_index(children, message):
    g, loss, _, _ = tree_rnn()
    n = max(len(children), 1)
    with pytest.raises(vg.StructureError, match=message):
        g.build({"children": children, "xs": np.ones((n, D))}, loss)
    assert g.latest_build is None and len(g.params) == 4  # nothing half-built


def test_state_misuse_is_refused_at_declaration():
    g = vg.VirtualGraph()
    kids = g.input("children", (None, 2))
    with g.recurse(kids) as r:
        h = r.state(np.zeros(2), name="h")
        with pytest.raises(vg.BuildError, match="recursion's state: read it at the children"):
            vg.tanh(h)
        with pytest.raises(vg.BuildError, match="declare per-node state with state"):
            r.carry(np.zeros(2))
        with pytest.raises(vg.ArgumentValueError, match=r"child\(\): j .* must be an int >= 0, got -1"):
            r.child(h, -1)
        with pytest.raises(vg.ArgumentError, match=r"must be an int >= 0, got float 1\.0"):
            r.child(h, 1.0)
        r.update(h, vg.tanh(r.child(h, 0)))
    with g.loop(times=2) as L:
        with pytest.raises(vg.BuildError, match="not a recursion"):
            L.state(np.zeros(2))
        c = L.carry(np.zeros(2))
        L.update(c, c)


def test_leaves_and_inner_nodes_by_a_branch_with_two_outputs():
    """Leaves embed their word; inner nodes combine their children — (h, c) pairs chosen by one
    branch whose decision is taken once per node."""
    g = vg.VirtualGraph(dtype=np.float64, seed=4)
    children = g.input("children", (None, 2))
    xs = g.input("xs", (None, D))
    is_leaf = g.input("is_leaf", (None,))
    W = g.parameter("W", (D, H))
    U = g.parameter("U", (2 * H, H))
    with g.recurse(children) as r:
        x, leaf = r.step(xs), r.step(is_leaf)
        h = r.state(np.zeros(H), name="h")
        c = r.state(np.zeros(H), name="c")
        both = vg.concat([r.child(h, 0), r.child(h, 1)], axis=-1)
        inner_h = vg.tanh(both @ U)
        inner_c = r.child(c, 0) + r.child(c, 1)
        h_new, c_new = g.branch(
            lambda v: int(v == 0), [(vg.tanh(x @ W), x @ W), (inner_h, inner_c)], keys=[leaf]
        )
        r.update(h, h_new)
        r.update(c, c_new)
    loss = vg.sum(r.final(h) ** 2) + vg.sum(r.final(c))
    kids = np.array([[-1, -1], [-1, -1], [0, 1], [-1, -1], [2, 3]])
    leaf_flags = (kids[:, 0] < 0).astype(float)
    values = np.random.default_rng(5).normal(size=(5, D))
    cg = g.build({"children": kids, "xs": values, "is_leaf": leaf_flags}, loss)
    branches = [d for d in cg.decisions if d.kind == "option"]
    assert [d.value for d in branches] == [0, 0, 1, 0, 1]  # one decision per node, not per output
    P = {k: g.params[k].value for k in g.params}
    hs, cs = {}, {}
    for t in range(5):
        if leaf_flags[t]:
            hs[t], cs[t] = np.tanh(values[t] @ P["W"]), values[t] @ P["W"]
        else:
            a, b = kids[t]
            hs[t], cs[t] = np.tanh(np.concatenate([hs[a], hs[b]]) @ P["U"]), cs[a] + cs[b]
    np.testing.assert_allclose(cg.forward(), np.sum(hs[4] ** 2) + np.sum(cs[4]), rtol=1e-12)
    vg.gradcheck(cg.outputs[0], [g.params["W"], g.params["U"]])


def test_a_deep_chain_needs_no_recursion():
    N = 3000
    children = np.array([[-1, -1]] + [[t - 1, -1] for t in range(1, N)])
    g, loss, _, _ = tree_rnn()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        cg = g.build({"children": children, "xs": np.full((N, D), 0.01)}, loss)
        cg.backward(loss)
    finally:
        sys.setrecursionlimit(limit)
    assert np.isfinite(g.params["W"].grad).all()


@pytest.mark.parametrize("programs", [True, False])
def test_cached_builds_recheck_the_structure(programs):
    """A second build with a same-shaped but different tree must not reuse the first tree's graph."""
    g, loss, _, h_new = tree_rnn()
    a = np.array([[-1, -1], [-1, -1], [0, 1]])
    b = np.array([[-1, -1], [0, -1], [1, -1]])  # a chain: same shape, another structure
    xs = np.random.default_rng(0).normal(size=(3, D))
    with vg.body_programs(programs):
        g.build({"children": a, "xs": xs}, loss)
        cached = g.build({"children": b, "xs": xs}, loss)
        fresh = g.build({"children": b, "xs": xs}, loss, cache=False)
    np.testing.assert_allclose(cached.forward(), fresh.forward(), rtol=1e-12)
    if programs:
        return
    left = [n for n in cached.nodes() if n.key.idx == (2,) and cached.node(h_new, (1,)) in n.parents]
    assert left  # node 2 reads node 1 (the chain), not node 0 and 1 (the first tree)
