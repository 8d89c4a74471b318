"""Attention over memories of different lengths, batched: write the model for one input.

Each input is a small dictionary — a memory of (key, value) token pairs, 3 to 10 of them, its
length its own — and a list of queries, keys of the dictionary in random order. A decoder loop
reads one query per step and answers with the value stored under it: it embeds the query, scores
it against every memory slot (``softmax(q @ memory.T)``, dot-product attention over this input's
own slots) and reads out the weighted values. The model is written for ONE input;
``g.build_batch(inputs, loss)`` trains on a minibatch of inputs whose memories have different
lengths, and runs the decoder of every input as one body program over rows: each input's memory
is padded to the longest and masked, so the attention of the whole minibatch is one step per query
(docs/batching.md).

The script first checks that a batched step gives the same loss and gradients as building the
inputs one at a time (float64) and that the decoder ran over rows, then trains with batches and
reports held-out accuracy (chance: one in the number of values) and words per second both ways.

    python examples/attention.py --steps 200 --batch 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

import vgraph as vg
from vgraph import losses, nn, optim
from vgraph.tbptt import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
from autobatch import largest_difference, step_alone  # (the same float64 check and one-at-a-time step)


def build_model(
    keys: int, values: int, dim: int, seed: int
) -> tuple[vg.VirtualGraph, vg.VirtualNode, vg.VirtualNode]:
    """One input: ``mem_keys`` / ``mem_values`` (slots,) integers, ``queries`` (steps,) keys and
    ``answers`` (steps,) values -> ``(g, loss, scores)``: the mean cross-entropy of the answers,
    and the answers' scores (steps, values)."""
    g = vg.VirtualGraph(seed=seed, name="key-value attention")
    mem_keys, mem_values = g.input("mem_keys", shape=(None,)), g.input("mem_values", shape=(None,))
    queries, answers = g.input("queries", shape=(None,)), g.input("answers", shape=(None,))
    key_emb = nn.Embedding(g, keys, dim, "key_emb")
    value_emb = nn.Embedding(g, values, dim, "value_emb")
    query = nn.Linear(g, dim, dim, "query")
    out = nn.Linear(g, 2 * dim, values, "out")
    memory_keys = key_emb(mem_keys)  # (slots, dim): this input's own length
    memory_values = value_emb(mem_values)  # (slots, dim)
    asked = key_emb(queries)  # (steps, dim)
    with g.loop(name="decoder") as loop:
        previous = loop.carry(np.zeros((1, dim)), name="previous")  # the last step's read-out
        q = vg.tanh(query(loop.step(asked).reshape(1, dim)))  # (1, dim)
        weights = vg.softmax(q @ memory_keys.T, axis=-1)  # (1, slots): over this input's slots
        read = weights @ memory_values  # (1, dim)
        logits = out(vg.concat([read, previous], axis=-1))  # (1, values)
        loop.update(previous, read)
    scores = loop.stack(logits).reshape(-1, values)  # (steps, values)
    return g, losses.cross_entropy(scores, answers), scores


def dictionaries(
    rng: np.random.Generator, n: int, keys: int, values: int, min_len: int, max_len: int
) -> list[dict]:
    """``n`` inputs: a memory of distinct keys with random values, queried in random order."""
    feeds = []
    for _ in range(n):
        slots = int(rng.integers(min_len, max_len + 1))
        k = rng.choice(keys, slots, replace=False)
        v = rng.integers(0, values, slots)
        order = rng.permutation(slots)
        feeds.append({"mem_keys": k, "mem_values": v, "queries": k[order], "answers": v[order]})
    return feeds


def step_batched(
    g: vg.VirtualGraph, loss: vg.VirtualNode, feeds: list[dict], reduction: str = "sum"
) -> float:
    """The sum (or mean) of the inputs' losses, and its gradient, from one batched build."""
    batch = g.build_batch(feeds, loss)
    if batch.inputs[0].interpreted:  # (the decoder is meant to run as one program over rows)
        raise RuntimeError(f"a loop ran op by op: {batch.inputs[0].interpreted}")
    return batch.backward(reduction)


def check_identical(args: argparse.Namespace) -> float:
    """Largest difference between a batched step (the decoder over rows) and a one-at-a-time
    step, in float64 (``autobatch.largest_difference``)."""
    feeds = dictionaries(
        np.random.default_rng(args.seed + 1), 8, args.keys, args.values, args.min_len, args.max_len
    )
    return largest_difference(
        lambda: build_model(args.keys, args.values, args.dim, args.seed)[:2], feeds, step_batched
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=200, help="training steps (minibatches)")
    p.add_argument("--batch", type=int, default=16, help="inputs per minibatch")
    p.add_argument("--keys", type=int, default=16, help="number of distinct keys")
    p.add_argument("--values", type=int, default=8, help="number of distinct values")
    p.add_argument("--dim", type=int, default=16, help="embedding size")
    p.add_argument("--min-len", type=int, default=3, help="fewest memory slots")
    p.add_argument("--max-len", type=int, default=10, help="most memory slots")
    p.add_argument("--lr", type=float, default=0.03, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and the data")
    Progress.add_option(p)
    args = p.parse_args(argv)

    difference = check_identical(args)
    print(f"batched vs one at a time: largest difference {difference:.1e} (float64)")

    g, loss, scores = build_model(args.keys, args.values, args.dim, args.seed)
    opt = optim.Adam(g.params, lr=args.lr)
    rng = np.random.default_rng(args.seed)
    words = 0
    start = time.perf_counter()
    history: list[float] = []
    with Progress(args.steps, desc="train", mode=args.progress, every=max(1, args.steps // 5)) as progress:
        for _ in range(args.steps):
            feeds = dictionaries(rng, args.batch, args.keys, args.values, args.min_len, args.max_len)
            opt.zero_grad()
            history.append(step_batched(g, loss, feeds, "mean"))
            opt.step()
            words += sum(len(f["queries"]) for f in feeds)
            progress.update(loss=float(np.mean(history[-20:])))
    batched_rate = words / (time.perf_counter() - start)

    # The same kind of step, one input at a time, for the speed comparison (a few steps).
    probe = [
        dictionaries(rng, args.batch, args.keys, args.values, args.min_len, args.max_len) for _ in range(5)
    ]
    start = time.perf_counter()
    for feeds in probe:
        opt.zero_grad()
        step_alone(g, loss, feeds)
    alone_rate = sum(len(f["queries"]) for feeds in probe for f in feeds) / (time.perf_counter() - start)

    test = dictionaries(
        np.random.default_rng(args.seed + 2), 200, args.keys, args.values, args.min_len, args.max_len
    )
    with vg.no_grad():
        batch = g.build_batch(test, [loss, scores])
    guesses = [batch.inputs[i].value(scores).argmax(axis=-1) for i in range(len(test))]
    accuracy = float(np.mean(np.concatenate([guess == f["answers"] for guess, f in zip(guesses, test)])))
    print(f"held-out accuracy {accuracy:.3f} (chance {1 / args.values:.3f})")
    print(
        f"answers/s: batched {batched_rate:,.0f}, one at a time {alone_rate:,.0f} ({batched_rate / alone_rate:.1f}x)"
    )
    return {
        "difference": difference,
        "accuracy": accuracy,
        "chance": 1 / args.values,
        "first_loss": float(np.mean(history[:10])),
        "final_loss": float(np.mean(history[-20:])),
        "speedup": batched_rate / alone_rate,
    }


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
