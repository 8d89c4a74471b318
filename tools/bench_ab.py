"""Paired A/B timing of the benchmark's training step between two versions of vgraph.

Two ``make bench`` runs of one commit can differ by 10% at the medium size on a shared machine
(docs/performance.md, "How to run it"): a change worth a few percent does not show in them. This tool
measures a change the way the performance notes quote one. The same model, batches and step as
``tools/bench_rnn.py`` (each version's own), in fresh processes that alternate between the two
versions — the order swapped every round, so a drift in the machine's speed hits both alike —
with BLAS on one thread; each process reports the median over its repeats of the mean step time
(thread CPU time); the tool prints each version's median over the rounds and the median of the
paired ratios new / old, with their range.

Usage::

    python tools/bench_ab.py OLD [NEW] [--sizes I,H,B,T ...] [--modes reuse rebuild rebuild-new]
                             [--rounds K] [--steps N] [--repeats R] [--interleave] [--json PATH]

``OLD`` and ``NEW`` are git revisions of this repository (checked out into temporary worktrees,
removed afterwards) or directories holding a vgraph checkout (a git working tree is copied first,
with its changes: both versions run from fresh copies, see :func:`checkouts`); ``NEW`` defaults to
this checkout's working tree. ``--interleave`` runs the hand-written floor's step between
vgraph's steps, as ``bench_rnn.py`` does (it leaves vgraph's data out of the caches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchcommon import BLAS_VARS  # (tools/, this script's directory, is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
SIZES = ["8,32,16,50", "32,128,32,50", "64,256,64,100", "8,32,1,1000"]
MODES = ("reuse", "rebuild", "rebuild-new")
#: Steps per repeat by size, so that one repeat takes some tens of milliseconds.
STEPS = {"8,32,16,50": 100, "32,128,32,50": 30, "64,256,64,100": 3, "8,32,1,1000": 10}
BLAS_ENV = dict.fromkeys(BLAS_VARS, "1")


def worker(root: str, size: str, mode: str, steps: int, repeats: int, interleave: bool) -> dict[str, Any]:
    """Time ``mode`` at ``size`` with the vgraph and benchmark of the checkout at ``root`` (run in
    a process of its own, BLAS already pinned by the caller's environment)."""
    import time

    sys.path[:0] = [root, str(Path(root) / "tools")]
    import bench_rnn as br

    import vgraph

    where = str(Path(vgraph.__file__).resolve())
    if not where.startswith(str(Path(root).resolve())):
        raise RuntimeError(f"imported vgraph from {where}, not from {root}")
    I, H, B, T = (int(v) for v in size.split(","))
    g, loss = br.make_model(I, H, B)
    lengths = br.length_schedule(T, steps * (repeats + 1)) if mode == "rebuild-new" else None
    data = br.make_data(I, B, max(lengths) if lengths else T)
    runner = br.VgraphReuse(g, loss, *data[0]) if mode == "reuse" else br.VgraphRebuild(g, loss)
    floor = br.NumpyTrainer(br.vgraph_param_values(g), br.numpy_grads) if interleave else None

    def batch(i: int) -> tuple[Any, Any]:
        x, y = data[i % len(data)]
        return (x[: lengths[i]], y) if lengths else (x, y)

    if lengths:  # every length once, the longest first: later builds resize, none unrolls afresh
        x, y = data[0]
        for n in sorted(set(lengths), reverse=True):
            runner.step(x[:n], y)
    for i in range(steps):  # warm-up: caches, compiled sweeps, the workspace
        runner.step(*batch(i))
    means = []
    for r in range(repeats):
        total = 0.0
        for i in range(steps * (r + 1), steps * (r + 2)):
            x, y = batch(i)
            if floor is not None:
                floor.step(x, y)
            t0 = time.thread_time()
            runner.step(x, y)
            total += time.thread_time() - t0
        means.append(total / steps * 1e3)
    return {"median_ms": statistics.median(means), "vgraph": where}


@contextlib.contextmanager
def checkouts(specs: Sequence[str]) -> Iterator[list[str]]:
    """The directories of ``specs``, each a fresh copy in one temporary directory, removed on
    exit: git revisions checked out into worktrees; a git working tree (this checkout's, by
    default) copied as it is, its changes and untracked files included (not the ignored ones).

    Two versions must run from the same kind of place: this checkout (its ``.venv``, its
    ``__pycache__``) timed against a fresh worktree of the same commit gave paired ratios of 1.04
    at (32, 128, 32, 50), mode rebuild, with no change at all (docs/performance.md, "How to run it").
    A directory that is not a git working tree is used where it is."""
    made: list[str] = []  # worktrees
    copied: list[str] = []
    tmp = tempfile.mkdtemp(prefix="vgraph-ab-")
    try:
        dirs = []
        for i, spec in enumerate(specs):
            if Path(spec).is_dir():
                files = subprocess.run(
                    ["git", "-C", spec, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                    capture_output=True, text=True,
                )  # fmt: skip
                if files.returncode:  # not a git working tree
                    dirs.append(str(Path(spec).resolve()))
                    continue
                path = str(Path(tmp) / f"{i}-copy")
                for name in filter(None, files.stdout.split("\0")):
                    source = Path(spec) / name
                    if source.is_file():  # (a tracked file deleted in the working tree: left out)
                        (Path(path) / name).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(source, Path(path) / name)
                copied.append(path)
                dirs.append(path)
                continue
            rev = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{spec}^{{commit}}"],
                capture_output=True, text=True,
            )  # fmt: skip
            if rev.returncode:
                raise SystemExit(f"bench_ab: {spec!r} is neither a directory nor a git revision of {ROOT}")
            path = str(Path(tmp) / f"{i}-{rev.stdout.strip()[:10]}")
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", path, rev.stdout.strip()],
                check=True,
            )
            made.append(path)
            dirs.append(path)
        yield dirs
    finally:
        for path in made:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path], check=False)
        for path in copied:
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(tmp)


def measure(root: str, size: str, mode: str, steps: int, repeats: int, interleave: bool) -> dict[str, Any]:
    """One worker process's result (see :func:`worker`)."""
    cmd = [sys.executable, __file__, "--worker", root, size, mode, str(steps), str(repeats)]
    cmd += ["--interleave"] if interleave else []
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **BLAS_ENV}, cwd=root)
    if out.returncode:
        raise RuntimeError(f"bench_ab worker failed ({root}, {size}, {mode}):\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def compare(
    old: str, new: str, sizes: Sequence[str], modes: Sequence[str], rounds: int,
    steps: int | None, repeats: int, interleave: bool,
) -> list[dict[str, Any]]:  # fmt: skip
    """Alternate the two checkouts ``rounds`` times per size and mode; one row per size and mode."""
    rows = []
    for size in sizes:
        n = steps or STEPS.get(size, 10)
        for mode in modes:
            times: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(rounds):
                order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
                for name, root in order:
                    times[name].append(measure(root, size, mode, n, repeats, interleave)["median_ms"])
            ratios = [b / a for a, b in zip(times["old"], times["new"])]
            rows.append({
                "size": size, "mode": mode, "old_ms": times["old"], "new_ms": times["new"],
                "old_median_ms": statistics.median(times["old"]),
                "new_median_ms": statistics.median(times["new"]),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            })  # fmt: skip
            row = rows[-1]
            print(
                f"{'(' + size + ')':18} {mode:12} {row['old_median_ms']:9.3f} {row['new_median_ms']:9.3f}"
                f"   {row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})",
                flush=True,
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="a git revision or a directory with a vgraph checkout")
    parser.add_argument("new", nargs="?", default=str(ROOT), help="the same (default: this working tree)")
    parser.add_argument("--sizes", nargs="+", default=SIZES, metavar="I,H,B,T")
    parser.add_argument("--modes", nargs="+", default=["reuse"], choices=MODES)
    parser.add_argument("--rounds", type=int, default=5, help="alternations per size and mode (default 5)")
    parser.add_argument("--steps", type=int, default=None, help="steps per repeat (default: by size)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per process (default 7)")
    parser.add_argument("--interleave", action="store_true", help="run the floor's step between vgraph's")
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--rounds, --repeats and --steps must be at least 1")
    with checkouts([args.old, args.new]) as (old, new):
        print(f"old: {args.old} ({old})\nnew: {args.new} ({new})")
        print(
            f"{'size (I,H,B,T)':18} {'mode':12} {'old ms':>9} {'new ms':>9}   new/old (paired median, range)"
        )
        rows = compare(
            old, new, args.sizes, args.modes, args.rounds, args.steps, args.repeats, args.interleave
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"old": args.old, "new": args.new, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, size, mode, steps, repeats = sys.argv[2:7]
        print(json.dumps(worker(root, size, mode, int(steps), int(repeats), "--interleave" in sys.argv)))
    else:
        main()
