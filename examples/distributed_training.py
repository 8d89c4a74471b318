"""Data-parallel training of the Tree-LSTM of ``examples/tree_lstm.py`` on several processes.

Every process holds the whole model; each global minibatch of expression trees is split across
the processes, each autobatches its share (``g.build_batch``), the gradients are averaged over
the processes (``vgraph.distributed.DistributedOptimizer``) and every process applies the same
update. The result is the one a single process would reach on the whole minibatches. Held-out
trees are then evaluated across the processes (``map_gather``) and the run can save and resume
its training state (``--checkpoint``), also on another number of processes.

Run::

    mpiexec -n 2 python examples/distributed_training.py      # two processes
    python examples/distributed_training.py                   # the same, in one process

(``pip install 'vgraph[mpi]'`` for mpiexec; see docs/distributed.md.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from vgraph import distributed as dist
from vgraph import optim
from vgraph.tbptt import Progress

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tree_lstm as tl


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=6, help="passes over the training trees")
    parser.add_argument("--trees", type=int, default=600, help="training trees")
    parser.add_argument("--batch", type=int, default=32, help="trees per global minibatch (all processes)")
    parser.add_argument("--max-leaves", type=int, default=4, help="most digits in a tree")
    parser.add_argument("--dim", type=int, default=24, help="token embedding size")
    parser.add_argument("--hidden", type=int, default=24, help="Tree-LSTM hidden units")
    parser.add_argument("--lr", type=float, default=2e-2, help="Adam learning rate")
    parser.add_argument("--test", type=int, default=200, help="held-out trees to evaluate on")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the parameters, the data and the shuffle"
    )
    parser.add_argument("--checkpoint", type=Path, help="save the training state here after every epoch")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint if it exists")
    Progress.add_option(
        parser,
        help="progress on rank 0: a tqdm bar (auto: in a terminal, when tqdm is installed), plain lines, or nothing",
    )
    args = parser.parse_args(argv)

    comm = dist.init()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    procs = f"{comm.size} process{'es' if comm.size > 1 else ''}"
    rng = np.random.default_rng(args.seed)  # the same data on every process
    leaves, modulus = (1, args.max_leaves), 10
    trees = [tl.make_forest(rng, 1, leaves, modulus) for _ in range(args.trees)]
    test = [tl.make_forest(rng, 1, leaves, modulus) for _ in range(args.test)]

    g, outs = tl.tree_lstm(args.dim, args.hidden, modulus, args.seed)
    opt = dist.DistributedOptimizer(optim.Adam(g.params, lr=args.lr), g, comm)
    # each minibatch split so that the processes get about as many tree nodes (equal work)
    data = dist.ShardedData(trees, comm, batch_size=args.batch, seed=args.seed, cost=lambda f: len(f.tokens))
    first = 0
    if args.resume and args.checkpoint is not None and args.checkpoint.exists():
        first = dist.load_training_state(comm, g, args.checkpoint, opt) or 0
        say(f"resumed from {args.checkpoint} after epoch {first}")
    say(f"{args.trees} trees, minibatches of {args.batch} split over {procs}")

    history = []
    for epoch in range(first, args.epochs):
        start = time.perf_counter()
        loss_sum = 0.0
        mode = args.progress if comm.rank == 0 else "off"
        with Progress(len(data), desc=f"epoch {epoch + 1}", mode=mode, unit="batch") as progress:
            for shard in data.batches(epoch):
                with dist.sampling(g, shard):  # dropout masks, if the model had any
                    if shard.count:  # a rank may get no tree of a small last minibatch
                        batch = g.build_batch([tl.tree_feed(f) for f in shard.items], outs["loss"])
                        loss_sum += batch.backward() * shard.count  # backward of the local mean
                opt.step(count=shard.count)  # gradient of the mean over the whole minibatch
                opt.zero_grad()
                progress.update()
        total = comm.allreduce_sum([np.array([loss_sum])])[0][0] / len(trees)
        seconds = time.perf_counter() - start
        history.append(float(total))
        say(f"epoch {epoch + 1}: mean loss {total:.4f}, {len(trees) / seconds:,.0f} trees/s on {procs}")
        if args.checkpoint is not None:
            dist.save_training_state(comm, g, args.checkpoint, opt, step=epoch + 1)

    g.eval()
    roots = dist.map_gather(lambda f: int(tl.predict_roots(g, outs, tl.tree_feed, f)[0]), test, comm)
    assert roots is not None
    truth = [int(f.labels[f.roots[0]]) for f in test]
    accuracy = float(np.mean(np.array(roots) == np.array(truth)))
    say(f"held-out accuracy of the whole expression: {accuracy:.3f} (chance {1 / modulus:.3f})")
    return {"losses": history, "accuracy": accuracy, "processes": comm.size, "pid": os.getpid()}


if __name__ == "__main__":
    main()
