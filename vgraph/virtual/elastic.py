"""Elastic structures: a cached graph re-used for another length of the sequences its loops step.

A loop that steps through a sequence unrolls one block of nodes per step, and every block of a
plain body (no inner loop, branch, sample or checkpoint) is the same declaration applied to the
same kind of values: the structure of a length-``T`` build is the structure of a longer build
with the blocks after ``T`` left out. So instead of unrolling a sentence of a length it has not
seen, a build can take the cached graph of a longer one (see :mod:`.cache`) and *resize* it: keep
the first ``T`` blocks of each such loop, point what reads the loop's outputs (its final carries,
its stacks) at block ``T - 1``, and replay. A training loop over sentences of many lengths then
unrolls only when a sentence is longer than any before it.

What a resized graph holds is exactly what a fresh build of the same feed would: the same nodes
with the same keys, parents, attributes and creation order, the same environments (``cg.node``),
decisions, hoisted groups and outputs; the replay then computes the same values (bit for bit:
the same ops in the same order) and re-checks every guard, including each loop's length check, so a
wrong guess of a loop's length (read from the feed, see :attr:`Trace.predictor`) only costs a fresh
build. The blocks left out stay with the cached graph, outside its node list and without their
values (memory is that of the current length's graph, not of the longest seen), for a later
longer feed, which computes them again: nodes taken from an earlier graph for steps past the new
length are not part of the new build (using them with it raises, as for any node of another
graph).

Which loops are elastic: loops that step through sequences (``loop.step``) and have no
``times=``, ``while_``/``until``, recursion structure or ``checkpoint=``, whose body makes no
decision (no inner loop or branch), samples nothing and creates no leaf after its first step, and
whose hoisted work does not depend on the trip count (no hoisted ``reshape``). They may sit inside
other loops (the layers of a stacked RNN): each instance is resized, and the enclosing loops'
own decisions are re-checked by their guards like any other. A graph is resized only if nothing
outside an elastic loop reads one of its body nodes other than its final carries and stacks;
otherwise it is cached by its exact input shapes, as before.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..compute import ComputeNode, backward_order, computed_ops
from ..ops import OPS, Op
from ..tape import BackwardTape, Call, ForwardTape, backward_calls, forward_calls, tapes_enabled

if TYPE_CHECKING:
    from .nodes import LoopNode, VirtualNode
    from .unrolled import UnrolledGraph

_GETITEM = OPS["GetItem"]
Env = dict["VirtualNode", Any]
#: A part of the node list: its forward segments, its backward plan, its backward segments.
_Part = tuple[list[Call], list[ComputeNode], list[Call]]


class Trace:
    """What a build records of one instance of a loop that steps through sequences (see the
    module docstring), for :class:`Elastic` to analyse if the graph is cached."""

    __slots__ = (
        "loop", "idx", "check", "guard", "groups", "seqs", "start", "ends", "envs", "stacks", "decision",
        "counts", "blocks", "predictor", "finals", "copies", "reversed", "least", "keyed", "env_at",
        "parts", "by_length",
    )  # fmt: skip

    def __init__(
        self,
        loop: LoopNode,
        cg: UnrolledGraph,
        guard: ComputeNode,
        check: Callable[[int], Callable[..., int]],
        groups: Sequence[ComputeNode],
        seqs: Sequence[ComputeNode],
    ) -> None:
        """Start recording ``loop`` just before its first step.

        Args:
            guard: the loop's length check; ``check(T)`` makes the check of a length-``T`` build.
            groups: the loop's hoisted groups.
            seqs: the sequences it steps through, as built.
        """
        self.loop, self.guard, self.check, self.groups, self.seqs = loop, guard, check, groups, seqs
        self.idx = guard.key.idx  # the loop's iteration path (inside a loop of fixed trip count)
        self.start = len(cg._nodes)
        self.counts = (len(cg.decisions), len(cg._guards), len(cg._samples))
        self.ends: list[int] = []  # where each step's block ends in the node list
        self.envs: list[Env] = []  # each step's environment
        self.stacks: list[tuple[ComputeNode, tuple[ComputeNode, ...], tuple[Any, ...]]] = []
        self.decision = -1  # the index of the loop's trip count in cg.decisions
        # Set by Elastic's analysis:
        self.blocks: list[list[ComputeNode]] = []  # each step's nodes, in creation order
        self.predictor: str | int = ""  # see _predictor
        self.finals: list[ComputeNode] = []  # each carry's final node as built
        self.copies: list[tuple[ComputeNode, list[ComputeNode]]] = []  # hoisted groups' copies
        self.reversed: list[tuple[ComputeNode, int]] = []  # reversed steps' items (not hoisted)
        self.least = 1  # the fewest steps a resize may leave
        self.keyed: list[dict[Any, ComputeNode]] = []  # each block's nodes by key
        self.env_at = 0  # where the environment of its first step is in the build's
        self.parts: list[_Part | None] = []  # each block's compiled segments, once made
        self.by_length: dict[int, tuple[Op, Any]] = {}  # a length's check op and decision, once made

    def owns(self, scope: Any, idx: tuple[int, ...]) -> bool:
        """Whether ``(scope, idx)`` names a step of this instance of the loop."""
        return scope is self.loop and idx[:-1] == self.idx

    def close(self, cg: UnrolledGraph, stacks: Sequence[ComputeNode]) -> bool:
        """Finish the record once the loop's decision and stacks are made; ``False`` if the body
        made a decision, a guard or a sample of its own (the loop is then not elastic)."""
        decisions, guards, samples = self.counts
        if (len(cg.decisions), len(cg._guards), len(cg._samples)) != (decisions + 1, guards, samples):
            return False
        self.decision = decisions
        self.stacks = [(s, s.parents, s.vjps) for s in stacks]
        return bool(self.ends)


class Elastic:
    """The traces of a build's stepping loops, analysed when the graph is cached, and the resizing
    of the graph to other lengths (see the module docstring)."""

    #: How many lengths' joined tapes :meth:`_retape` keeps (least recently used dropped first).
    RETAPED = 32

    def __init__(self, traces: list[Trace], cg: UnrolledGraph) -> None:
        self.traces = traces
        self.count = len(cg._nodes)  # the node count of the graph as built (and as resized last)
        self.lengths = [len(t.ends) for t in traces]
        self.deferred = cg._deferred  # nodes computed when read: in no forward part
        self._ready: bool | None = None

    def analyse(self, cg: UnrolledGraph) -> bool:
        """Whether the graph can be resized; analysed once (see the module docstring)."""
        if self._ready is None:
            self._ready = self._analyse(cg)
        return self._ready

    def _analyse(self, cg: UnrolledGraph) -> bool:
        nodes = list(cg._nodes.values())  # as built: analysed when the build is cached
        inputs = {n: name for name, n in cg.inputs.items()}
        stacks = {s: i for i, tr in enumerate(self.traces) for s, _, _ in tr.stacks}
        member: dict[ComputeNode, int] = {}  # a body node -> the index of its loop's trace
        finals: dict[ComputeNode, int] = {}  # a final carry that is a body node -> that index
        self.regions: list[list[ComputeNode]] = []  # the nodes between loops
        pos = 0
        for i, tr in enumerate(self.traces):
            if tr.start < pos:
                return False  # (loops recorded in creation order, none inside another)
            bounds = [tr.start, *tr.ends]
            tr.blocks = [nodes[a:b] for a, b in itertools.pairwise(bounds)]
            if any(n.op is None for block in tr.blocks[1:] for n in block):
                return False  # a leaf made after the first step (an untied parameter)
            if any(g.key.type == "Reshape*" for g in tr.groups):
                return False  # its attributes hold the trip count
            predictor = _predictor(tr.seqs, len(tr.blocks), inputs, stacks)
            if predictor is None:
                return False
            tr.predictor = predictor
            self.regions.append(nodes[pos : tr.start])
            pos = tr.ends[-1]
            for block in tr.blocks:
                member.update(dict.fromkeys(block, i))
            loop = tr.loop
            tr.finals = [tr.envs[-1][loop.updates[c]] for c in loop.carries]
            finals.update({f: i for f in tr.finals if member.get(f) == i})
            # (a reassociated sum's group has no copies if every iteration built the sum as declared)
            tr.copies = [(g, list(cg._groups[g])) for g in tr.groups if g in cg._groups]
            tr.reversed = [
                (env[item], t)
                for t, env in enumerate(tr.envs)
                for item in loop.items
                if item.attrs.get("reverse") and env[item].op is _GETITEM
            ]
            tr.least = 2 if tr.groups else 1  # a one-step loop is not hoisted
        self.regions.append(nodes[pos:])
        # What reads a body node from outside its loop: a final carry's readers are re-pointed
        # when resizing, a stack is re-made; anything else and the graph is not elastic.
        self.readers: dict[ComputeNode, tuple[ComputeNode, ...]] = {}
        for n in nodes:
            own, stack = member.get(n), stacks.get(n)
            reads = False
            for p in n.parents:
                j = member.get(p)
                if j is None or j in (own, stack):
                    continue
                if finals.get(p) != j:
                    return False
                reads = True
            if reads and stack is None:  # a stack's parents are re-made whole
                self.readers[n] = n.parents
        # Environments outside a loop that hold its final carries (the top level's, a later
        # loop's captures), in the order a build makes them.
        self.envs = list(cg._envs.items())
        where = {k: i for i, (k, _) in enumerate(self.envs)}
        for tr in self.traces:  # a loop's steps' environments follow one another
            tr.env_at = where[(tr.loop, (*tr.idx, 0))]
            if [k for k, _ in self.envs[tr.env_at : tr.env_at + len(tr.blocks)]] != [
                (tr.loop, (*tr.idx, t)) for t in range(len(tr.blocks))
            ]:
                return False
            tr.keyed = [{n.key: n for n in block} for block in tr.blocks]
        self.keyed = [{n.key: n for n in region} for region in self.regions]
        self.env_finals = [
            (env, v, node)
            for (scope, idx), env in self.envs
            for v, node in env.items()
            if node in finals and not self.traces[finals[node]].owns(scope, idx)
        ]
        self.outputs = list(cg.outputs)
        # Nodes whose parents a resize changes; the compiled segments of a part without any are
        # kept by (region, k) or (loop k, step t).
        self.volatile = {*self.readers, *stacks}
        self.region_parts: list[_Part | None] = [None] * len(self.regions)
        # The tapes of each length resized to (the most recent RETAPED): a region part that reads
        # a final carry is re-pointed by every resize, but the same lengths point it the same way.
        self.retaped: OrderedDict[tuple[int, ...], tuple[ForwardTape, list[ComputeNode], BackwardTape]]
        self.retaped = OrderedDict()
        for tr in self.traces:
            tr.parts = [None] * len(tr.blocks)
        return True

    def resize(self, cg: UnrolledGraph, values: Mapping[str, np.ndarray]) -> bool:
        """Make ``cg`` the graph of a build of ``values`` (before its replay); ``False`` (and
        ``cg`` unchanged) if it cannot be: a loop's length out of the recorded range, or nodes
        added to the graph since."""
        if len(cg._nodes) != self.count or not self.analyse(cg):  # (nodes added since the build)
            return False
        lengths: list[int] = []
        for tr in self.traces:
            if isinstance(tr.predictor, int):  # it steps through an earlier loop's stack
                n = lengths[tr.predictor]
            else:
                fed = values.get(tr.predictor)
                n = fed.shape[0] if fed is not None and fed.ndim else 0
            if not tr.least <= n <= min(len(tr.blocks), tr.loop.max_iters):
                return False
            lengths.append(n)
        if lengths == self.lengths:
            return True
        # Nothing below can fail: the graph is changed only once the new lengths are known good.
        subst: dict[ComputeNode, ComputeNode] = {}  # a final carry as built -> as resized
        changed: set[ComputeNode] = set()
        for tr, n in zip(self.traces, lengths):
            loop, env = tr.loop, tr.envs[n - 1]
            for orig, c in zip(tr.finals, loop.carries):
                x: ComputeNode = env[loop.updates[c]]
                subst[orig] = subst.get(x, x)
            for s, bucket, vjps in tr.stacks:  # (Stack is variadic: one VJP per input)
                s.parents = tuple([subst.get(p, p) for p in bucket[:n]])
                s.vjps = vjps[:n]
                changed.add(s)
            made = tr.by_length.get(n)
            if made is None:
                decision = cg.decisions[tr.decision]._replace(value=n)
                made = tr.by_length[n] = (_length_op(tr, n), decision)
            tr.guard.op, cg.decisions[tr.decision] = made
            changed.add(tr.guard)
            for node, t in tr.reversed:
                if t < n:
                    node.attrs["index"] = n - 1 - t
                    changed.add(node)
            for g, copies in tr.copies:
                cg._groups[g] = copies[:n]
        for node, parents in self.readers.items():
            node.parents = tuple([subst.get(p, p) for p in parents])
            changed.add(node)
        old = self.lengths
        for tr, n, o in zip(self.traces, lengths, old):
            for left in tr.blocks[n:o]:  # left out: keep no values (and no views of old groups)
                for dropped in left:
                    if dropped.parents:  # (an op of no inputs is never computed again)
                        dropped._value = None
                        dropped.version = 0  # recomputed if a longer feed takes its block back
        for node in changed:
            node.version = 0  # recomputed by the replay whatever its parents' versions
        for env, v, orig in self.env_finals:
            env[v] = subst.get(orig, orig)
        cg.outputs[:] = [subst.get(o, o) for o in self.outputs]
        # The environments of the new length, in the order a build makes them (slices of one list
        # made once), and its node list, changed in place where the old one had the new one's
        # order: blocks left out are deleted; from the first loop that gets longer on, the nodes
        # are taken off and added again in order (dict.update copies at C speed).
        envs: list[tuple[Any, Env]] = []
        start = 0
        for tr, n in zip(self.traces, lengths):
            envs += self.envs[start : tr.env_at + n]
            start = tr.env_at + len(tr.blocks)
        envs += self.envs[start:]
        cg._envs = dict(envs)
        nodes = cg._nodes
        first = next((k for k, (n, o) in enumerate(zip(lengths, old)) if n > o), len(lengths))
        for tr, n, o in zip(self.traces[:first], lengths, old):  # before the first that grows
            for block in tr.keyed[n:o]:
                for key in block:
                    del nodes[key]
        if first < len(lengths):  # what follows its old blocks: taken off, added back in order
            tail = [self.keyed[first + 1]]
            for k in range(first + 1, len(lengths)):
                tail += [*self.traces[k].keyed[: old[k]], self.keyed[k + 1]]
            for part in tail:
                for key in part:
                    del nodes[key]
            for block in self.traces[first].keyed[old[first] : lengths[first]]:
                nodes.update(block)
            for k in range(first + 1, len(lengths)):
                nodes.update(self.keyed[k])
                for block in self.traces[k].keyed[: lengths[k]]:
                    nodes.update(block)
            nodes.update(self.keyed[-1])
        self.count, self.lengths = len(nodes), lengths
        cg._forget_plans()  # made for the old node list
        if tapes_enabled():
            self._retape(cg, lengths)
        return True

    def _retape(self, cg: UnrolledGraph, lengths: list[int]) -> None:
        """Give ``cg`` its replay tape and backward plan and tape at once, made of each part's
        compiled segments (a part: the nodes between loops, or one step's block). A part none of
        whose nodes is re-pointed by resizing keeps its segments from one resize to the next, so
        a resize compiles only what it re-pointed and the blocks no earlier length had; and the
        joined tapes of the last :attr:`RETAPED` lengths are kept whole (a training loop cycles
        through a few dozen sentence lengths: joining them again cost 150 µs per build at
        (32, 128, 32, 50))."""
        key = tuple(lengths)
        joined = self.retaped.get(key)
        if joined is not None:
            self.retaped.move_to_end(key)
        else:
            joined = self.retaped[key] = self._joined(lengths)
            if len(self.retaped) > self.RETAPED:
                self.retaped.popitem(last=False)
        cg._replay_tape = joined[0]
        cg._use_backward_plan(joined[1], joined[2])

    def _joined(self, lengths: list[int]) -> tuple[ForwardTape, list[ComputeNode], BackwardTape]:
        """The replay tape, backward plan and backward tape of a graph resized to ``lengths``."""
        parts: list[_Part] = []
        for k, region in enumerate(self.regions):
            parts.append(self._part(self.region_parts, k, region))
            if k < len(self.traces):
                tr = self.traces[k]
                for t in range(lengths[k]):
                    parts.append(tr.parts[t] or self._part(tr.parts, t, tr.blocks[t]))
        forward: list[Call] = []
        plan: list[ComputeNode] = []
        backward: list[Call] = []
        for part in parts:
            forward += part[0]
        for part in reversed(parts):
            plan += part[1]
            backward += part[2]
        return ForwardTape.joined(forward), plan, BackwardTape.joined(backward)

    def _part(self, cache: list[_Part | None], i: int, nodes: list[ComputeNode]) -> _Part:
        """Part ``i``'s segments, from ``cache`` or made (and kept there if no resize re-points
        any of its nodes)."""
        part = cache[i]
        if part is None:
            grads = backward_order(nodes, self.deferred)  # this part of ComputeGraph._backward_plan
            part = (forward_calls(computed_ops(nodes, self.deferred)), grads, backward_calls(grads))
            if self.volatile.isdisjoint(nodes):
                cache[i] = part
        return part


def _length_op(tr: Trace, n: int) -> Op:
    """The op of ``tr``'s length check for a length-``n`` build."""
    return dataclasses.replace(cast(Op, tr.guard.op), forward=tr.check(n))


def _predictor(
    seqs: Sequence[ComputeNode], length: int, inputs: dict[ComputeNode, str], stacks: dict[ComputeNode, int]
) -> str | int | None:
    """What gives the loop's length: the name of the input whose leading axis it is, or the index
    of the earlier loop whose stack it steps through (a layer of a stacked RNN). Found by walking
    up from the stepped sequences through values of that leading length: a guess, which the
    loop's length check verifies when the resized graph is replayed."""
    seen: set[ComputeNode] = set()
    todo = list(seqs)
    while todo and len(seen) < 64:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        name = inputs.get(n)
        if name is not None:
            return name
        if n in stacks:
            return stacks[n]
        todo += [p for p in n.parents if np.ndim(p._value) and np.shape(p._value)[0] == length]
    return None


def elastic_key(key: tuple[Any, ...], values: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """The cache key of a build's structure with the leading axis of every input left out (what an
    elastic graph is cached by)."""
    return (*key, "elastic", *((n, a.shape[1:], a.ndim, a.dtype.str) for n, a in values.items()))
