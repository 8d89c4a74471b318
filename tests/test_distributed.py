"""vgraph.distributed: the one-rank path in-process, the MPI path under ``mpiexec`` (subprocess).

The MPI tests need ``mpiexec`` (``pip install mpi4py mpich``); without it they are skipped, unless
``VGRAPH_REQUIRE_MPI=1``, when they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import vgraph as vg
from vgraph import distributed as dist
from vgraph import losses, optim

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "mpi_scripts"


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return found


MPIEXEC = _mpiexec()


@pytest.fixture
def mpiexec() -> str:
    if MPIEXEC is None:
        if os.environ.get("VGRAPH_REQUIRE_MPI") == "1":
            pytest.fail(
                "VGRAPH_REQUIRE_MPI=1 but mpiexec or mpi4py is not available (pip install mpi4py mpich)"
            )
        pytest.skip(
            "mpiexec or mpi4py not available (pip install mpi4py mpich); set VGRAPH_REQUIRE_MPI=1 to fail"
        )
    return MPIEXEC


def run_mpi(
    mpiexec: str, n: int, *args: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in dist._LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = "1"
    start = time.monotonic()
    proc = subprocess.run(
        [mpiexec, "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    return proc, time.monotonic() - start


def result(proc: subprocess.CompletedProcess) -> dict:
    import json

    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][len("RESULT ") :])


# ---------------------------------------------------------------------------- under mpiexec


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("model", ["rnn", "batched", "tree", "tbptt"])
def test_data_parallel_equals_one_process(mpiexec: str, model: str, ranks: int) -> None:
    """K steps on P ranks, each on its (uneven) shard of a minibatch of 7, give the parameters of
    one process on the whole minibatch (float64, 1e-12 relative): an RNN with dropout and untied
    per-step biases created on some ranks only, the same autobatched, a Tree-LSTM with a sparse
    embedding gradient, truncated BPTT with each rank carrying its share of 5 streams."""
    proc, _ = run_mpi(mpiexec, ranks, str(SCRIPTS / "equivalence.py"), model, "8")
    res = result(proc)
    assert res["ranks"] == ranks
    assert res["max_rel_err"] <= 1e-12
    if model in ("rnn", "batched"):
        assert res["untied"] >= 5  # sequences of 1..8 steps: untied copies appeared along the way


def test_untied_copies_some_ranks_lack_are_broadcast_once(mpiexec: str) -> None:
    """Copies that only some ranks hold when the optimiser is made (on the root only, and on
    another rank only) and copies created during training each reach the other ranks in one
    broadcast, and every rank ends with the same values: root's for a parameter root has, the
    owner's for one it lacks."""
    proc, _ = run_mpi(mpiexec, 2, str(SCRIPTS / "untied.py"))
    res = result(proc)
    assert res["equal"] and res["expected"]
    names = ["W", "a@0", "a@1", "a@2", "a@3", "b@0", "b@1", "b@2", "b@3"]
    assert res["sent"] == {name: 1 for name in names}


def test_resume_on_another_number_of_ranks(mpiexec: str, tmp_path: Path) -> None:
    """Saved by rank 0 after 3 steps on 2 ranks, resumed on 3 ranks (and on 1) to 7 steps: the
    parameters of one process that trained 7 steps without stopping (dropout counter included)."""
    ck = tmp_path / "state.npz"
    proc, _ = run_mpi(mpiexec, 2, str(SCRIPTS / "equivalence.py"), "rnn", "3", "--save", str(ck))
    assert proc.returncode == 0, proc.stderr
    assert ck.exists() and not [p for p in tmp_path.iterdir() if p != ck]  # atomic: no temp left
    proc, _ = run_mpi(mpiexec, 3, str(SCRIPTS / "equivalence.py"), "rnn", "7", "--resume", str(ck))
    assert result(proc)["max_rel_err"] <= 1e-12
    one = subprocess.run(
        [sys.executable, str(SCRIPTS / "equivalence.py"), "rnn", "7", "--resume", str(ck)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result(one)["max_rel_err"] <= 1e-12


def test_exception_on_one_rank_ends_every_rank(mpiexec: str) -> None:
    proc, seconds = run_mpi(mpiexec, 2, str(SCRIPTS / "failures.py"), "raise")
    assert proc.returncode != 0
    assert seconds < 10
    assert "rank 1 of 2 failed: ValueError: boom on purpose" in proc.stderr


def test_killed_rank_does_not_hang(mpiexec: str) -> None:
    proc, seconds = run_mpi(mpiexec, 2, str(SCRIPTS / "failures.py"), "kill")
    assert proc.returncode != 0
    assert seconds < 10  # rank 0 waits in a collective with a 60 s timeout: mpiexec ended it


def test_collective_timeout_is_an_error(mpiexec: str) -> None:
    proc, seconds = run_mpi(mpiexec, 2, str(SCRIPTS / "failures.py"), "timeout")
    assert proc.returncode != 0
    assert seconds < 10  # rank 1 sleeps 30 s: the abort ended it
    assert "rank 0 of 2 failed: CollectiveTimeoutError" in proc.stderr
    assert "did not complete within 1 s (timeout)" in proc.stderr


def test_parameter_mismatch_names_rank_and_parameter(mpiexec: str) -> None:
    proc, seconds = run_mpi(mpiexec, 2, str(SCRIPTS / "failures.py"), "mismatch")
    assert proc.returncode != 0 and seconds < 10
    assert "ParameterMismatchError" in proc.stderr
    assert "rank 1: parameter 'W' has shape (3, 4)" in proc.stderr


def test_count_on_some_ranks_only_is_an_error(mpiexec: str) -> None:
    proc, seconds = run_mpi(mpiexec, 2, str(SCRIPTS / "failures.py"), "count")
    assert proc.returncode != 0 and seconds < 10
    assert "ranks [0] passed count= to step() and the others did not" in proc.stderr


def test_example_runs_on_two_ranks(mpiexec: str) -> None:
    proc, _ = run_mpi(mpiexec, 2, "examples/distributed_training.py", "--epochs", "2", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 processes" in proc.stdout
    assert proc.stdout.count("epoch") >= 2


# ---------------------------------------------------------------------------- one process


def test_one_rank_without_mpiexec() -> None:
    comm = dist.init()
    assert (comm.rank, comm.size, comm.is_mpi) == (0, 1, False)
    assert comm.allgather({"a": 1}) == [{"a": 1}]
    assert comm.bcast([1, 2]) == [1, 2]
    x = np.arange(3.0)
    assert np.array_equal(comm.allreduce_sum([x])[0], x)
    comm.barrier()


def test_equivalence_script_in_one_process() -> None:
    """The MPI test script itself runs without mpiexec (the one-rank fallback)."""
    env = {k: v for k, v in os.environ.items() if k not in dist._LAUNCHER_VARS}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "equivalence.py"), "tree", "3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert result(proc) == {"max_rel_err": 0.0, "params": 6, "untied": 0, "ranks": 1}


def _model() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
    g = vg.VirtualGraph(dtype=np.float64, seed=1)
    x = g.input("x", (None, 3))
    y = g.input("y", (None,))
    W = g.parameter("W", (3, 2))
    return g, losses.cross_entropy(x @ W, y)


def test_one_rank_optimizer_is_the_plain_optimizer() -> None:
    feed = {"x": np.arange(6.0).reshape(2, 3), "y": np.array([0, 1])}
    finals = []
    for wrap in (False, True):
        g, loss = _model()
        opt: optim.Optimizer | dist.DistributedOptimizer = optim.Adam(g.params, lr=0.1)
        if wrap:
            opt = dist.DistributedOptimizer(opt, g)  # type: ignore[arg-type]
        for _ in range(3):
            g.build(feed, loss).backward(loss)
            opt.step(count=2) if wrap else opt.step()  # type: ignore[call-arg]
            opt.zero_grad()
        finals.append(g.params["W"].value)
    assert np.array_equal(finals[0], finals[1])


def test_optimizer_arguments_are_checked() -> None:
    g, _ = _model()
    with pytest.raises(TypeError, match=r"vgraph\.optim optimiser"):
        dist.DistributedOptimizer(object(), g)  # type: ignore[arg-type]
    opt = dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        opt.step(count=-1)
    opt.lr = 0.5
    assert opt.optimizer.lr == 0.5 and opt.lr == 0.5


def test_integer_arguments_are_typed_errors() -> None:
    """``count``, ``batch_size`` and ``seed``: a bool, a float or a string is an ArgumentError (a
    TypeError), a value below the minimum an ArgumentValueError (a ValueError); numpy integers
    are taken as Python ints."""
    g, _ = _model()
    opt = dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g, count=np.int64(3))
    assert opt.count == 3 and type(opt.count) is int
    for bad in (True, 1.5, "2"):
        with pytest.raises(vg.ArgumentError, match=f"count must be an int >= 0, got {type(bad).__name__}"):
            opt.step(count=bad)  # type: ignore[arg-type]
        with pytest.raises(vg.ArgumentError, match="count must be an int >= 0 or None"):
            dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g, count=bad)  # type: ignore[arg-type]
    with pytest.raises(vg.ArgumentValueError, match="count must be an int >= 0, got -1"):
        opt.step(count=-1)
    assert g.params["W"].grad is None  # nothing was stepped
    one = dist.Communicator()
    data = list(range(4))
    for kwargs, error, match in [
        ({"batch_size": True}, vg.ArgumentError, "batch_size must be an int >= 1, got bool True"),
        ({"batch_size": 2.0}, vg.ArgumentError, "batch_size must be an int >= 1, got float 2.0"),
        ({"batch_size": 0}, vg.ArgumentValueError, "batch_size must be an int >= 1, got 0"),
        ({"seed": np.bool_(True)}, vg.ArgumentError, "seed must be an int >= 0, got bool"),
        ({"seed": -1}, vg.ArgumentValueError, "seed must be an int >= 0, got -1"),
    ]:
        with pytest.raises(error, match=match):
            dist.ShardedData(data, one, **kwargs)
    sharded = dist.ShardedData(data, one, batch_size=np.int32(2), seed=np.uint8(7))
    assert (sharded.batch_size, sharded.seed, len(sharded)) == (2, 7, 2)
    assert type(sharded.batch_size) is int and type(sharded.seed) is int


def test_sharded_data_uses_every_example_once() -> None:
    """Over 3 ranks, 10 examples in minibatches of 4: shares of each minibatch are contiguous,
    differ by at most one, and cover every example once per epoch; the order is shuffled by the
    shared seed, differs by epoch, and does not depend on the number of ranks."""
    data = list(range(10))

    class Rank(dist.Communicator):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__()
            self.rank, self.size = rank, size

    for epoch in (0, 1):
        seen = []
        per_rank = [
            list(dist.ShardedData(data, Rank(r, 3), batch_size=4, seed=7).batches(epoch)) for r in range(3)
        ]
        assert [len(s) for s in per_rank] == [3, 3, 3]
        for step in range(3):
            shards = [per_rank[r][step] for r in range(3)]
            counts = [s.count for s in shards]
            assert max(counts) - min(counts) <= 1
            assert [s.offset for s in shards] == [0, counts[0], counts[0] + counts[1]]
            assert all(s.total == sum(counts) for s in shards)
            seen += [x for s in shards for x in s.items]
        one = dist.ShardedData(data, Rank(0, 1), batch_size=4, seed=7)
        assert seen == [data[i] for i in one.order(epoch)]
        assert sorted(seen) == data
    assert list(one.order(0)) != list(one.order(1))
    assert [s.count for s in per_rank[2]] == [2, 2, 1]  # rank 2 of 3: items [2, 4) of 4, [1, 2) of 2
    shares = [dist.ShardedData(data, Rank(r, 3), seed=7).indices(0) for r in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == data and [len(s) for s in shares] == [3, 3, 4]
    assert len(dist.ShardedData(data, Rank(0, 1), batch_size=4, drop_last=True)) == 2
    with pytest.raises(ValueError, match="batch_size"):
        dist.ShardedData(data, Rank(0, 1), batch_size=0)


def test_sharded_data_balances_cost() -> None:
    """With ``cost``, each minibatch is split by cost (largest first, to the least-loaded rank with
    room; the counts stay those of ``shard_range``) into contiguous parts of a rearranged
    minibatch; every example still used once."""

    class Rank(dist.Communicator):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank, self.size = rank, 2

    def shards(data: list[int]) -> list[dist.Shard]:
        return [
            next(dist.ShardedData(data, Rank(r), batch_size=len(data), shuffle=False, cost=float).batches(0))
            for r in range(2)
        ]

    a, b = shards([9, 1, 1, 8])  # 9 -> rank 0, 8 -> rank 1, 1 -> rank 1, 1 -> rank 0 (no room on 1)
    assert (a.items, b.items) == ([9, 1], [1, 8])
    assert (a.indices.tolist(), b.indices.tolist()) == ([0, 2], [1, 3])
    assert (a.count, b.count, a.offset, b.offset, a.total) == (2, 2, 0, 2, 4)
    a, b = shards([5, 1, 1, 1, 1])  # counts stay 2 and 3: 5 -> rank 0, then rank 1 until full
    assert (a.items, b.items) == ([5, 1], [1, 1, 1])
    a, b = shards([3, 3, 2, 2, 1, 1])
    assert (a.indices.tolist(), b.indices.tolist()) == ([0, 2, 4], [1, 3, 5])  # costs 6 and 6
    with pytest.raises(TypeError, match="cost must be a function"):
        dist.ShardedData([1], Rank(0), cost=3)  # type: ignore[arg-type]


def test_sampling_draws_the_masks_of_one_process() -> None:
    """Dropout masks drawn inside ``sampling`` for a shard at offset 2 are those of inputs 2, 3 of
    a one-process batch, and the counter ends where the one-process run's does."""
    from vgraph import nn

    def model() -> tuple[vg.VirtualGraph, vg.VirtualNode]:
        g = vg.VirtualGraph(dtype=np.float64, seed=4)
        x = g.input("x", (5,))
        return g, nn.Dropout(g, 0.5)(x)

    feeds = [{"x": np.ones(5)} for _ in range(5)]
    g1, out1 = model()
    whole = [np.asarray(g1.build(f, out1).forward()) for f in feeds]
    g2, out2 = model()
    shard = dist.Shard(feeds[2:4], np.arange(2, 4), offset=2, count=2, total=5, step=0)
    with dist.sampling(g2, shard):
        part = [np.asarray(g2.build(f, out2).forward()) for f in shard.items]
    assert np.array_equal(part[0], whole[2]) and np.array_equal(part[1], whole[3])
    assert not np.array_equal(whole[2], whole[3])
    after = np.asarray(g2.build(feeds[0], out2).forward())
    assert np.array_equal(after, np.asarray(g1.build(feeds[0], out1).forward()))


def test_map_gather_in_order() -> None:
    assert dist.map_gather(lambda x: x * x, [1, 2, 3]) == [1, 4, 9]
    assert dist.shard_range(10, 2, 3) == (6, 10)
    assert dist.shard_range(2, 2, 3) == (1, 2) and dist.shard_range(2, 0, 3) == (0, 0)


def test_checkpoint_round_trip_in_one_process(tmp_path: Path) -> None:
    feed = {"x": np.arange(6.0).reshape(2, 3), "y": np.array([0, 1])}
    g, loss = _model()
    comm = dist.init()
    opt = dist.DistributedOptimizer(optim.Adam(g.params, lr=0.1), g, comm)
    g.build(feed, loss).backward(loss)
    opt.step()
    dist.save_training_state(comm, g, tmp_path / "s.npz", opt, step=1)
    g2, _ = _model()
    opt2 = dist.DistributedOptimizer(optim.Adam(g2.params, lr=0.1), g2, comm)
    assert dist.load_training_state(comm, g2, tmp_path / "s.npz", opt2) == 1
    assert np.array_equal(g2.params["W"].value, g.params["W"].value)
    assert opt2.state_dict()["state"]["W"]["step"] == 1


def test_init_timeout_is_checked() -> None:
    with pytest.raises(ValueError, match="timeout"):
        dist.init(timeout=0)


def test_a_failing_rank_waits_until_its_message_is_read_from_the_pipe(tmp_path) -> None:
    """Before aborting, the failing rank waits until the launcher has read its message from the
    pipe its output goes through (an abort that ends the launcher's forwarding first lost it,
    under load); at most the limit, and not at all for a file."""
    import threading

    r, w = os.pipe()
    with os.fdopen(w, "w") as out, os.fdopen(r, "rb") as inp:
        out.write("rank 1 of 2 failed\n" * 10)
        out.flush()
        got: list[bytes] = []
        reader = threading.Timer(0.3, lambda: got.append(inp.read1(4096)))
        reader.start()
        start = time.monotonic()
        dist._drain(out, limit=5.0)
        waited = time.monotonic() - start
        reader.join()
        assert 0.25 < waited < 2.0 and got and got[0].startswith(b"rank 1 of 2 failed")
        out.write("never read\n")
        out.flush()
        start = time.monotonic()
        dist._drain(out, limit=0.3)
        assert 0.25 < time.monotonic() - start < 2.0
    with open(tmp_path / "log", "w") as f:
        f.write("x")
        f.flush()
        start = time.monotonic()
        dist._drain(f, limit=5.0)
        assert time.monotonic() - start < 0.5
