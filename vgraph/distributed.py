"""Data-parallel training and inference over MPI (``mpi4py``), with a one-process fallback.

Every process (*rank*) holds the whole model and trains on its shard of each minibatch; after
backward the gradients are combined across ranks before the optimiser's step, so every rank
applies the same update and the parameters stay equal. A script changes in a few lines::

    from vgraph import distributed as dist

    comm = dist.init()                                         # MPI world, or one rank without MPI
    opt = dist.DistributedOptimizer(optim.Adam(g.params, lr=1e-3), g, comm)  # broadcast + check
    data = dist.ShardedData(examples, comm, batch_size=64, seed=0)
    for shard in data.batches(epoch):                          # this rank's part of each minibatch
        batch = g.build_batch([feed(x) for x in shard.items], loss)
        batch.backward()                                       # mean over the local examples
        opt.step(count=shard.count)                            # all-reduce, then the update
        opt.zero_grad()

**Exact averaging.** With ``count=`` the gradient applied is ``Σ_r count_r · g_r / Σ_r count_r``
where ``g_r`` is rank ``r``'s gradient of its *mean* loss over its ``count_r`` examples: the gradient
of the mean loss over the whole minibatch, whatever the split (uneven shards and empty ones
included). Without ``count=`` every rank weighs 1 (the mean of the ranks' means), which is the same
only when the shards are equal. A rank with no examples calls ``step(count=0)`` without a backward.

**What is communicated.** One exchange of a small header per step (which parameters have a
gradient, the row counts of sparse ones), then, concurrently, one flattened all-reduce of every
dense gradient per dtype and one all-gather of the rows and indices of every row-sparse
gradient (:class:`~vgraph.ops.RowSparseGrad`, ``nn.Embedding(..., sparse=True)``), which are
concatenated and summed (repeated rows coalesced). A parameter none of the ranks has a gradient
for keeps ``.grad = None`` (its optimiser state does not advance, as in one process).

**Untied parameter copies** (``"W@7"``, created by the first build that reaches iteration 7) may
exist on some ranks only. When the ranks' parameter names differ, the step first agrees on their
union (sorted by name): a rank lacking a copy creates it with the value of the lowest rank that has
it (one broadcast from each rank that holds copies others lack), so every rank holds every copy
with the same value from then on.

**Failures.** :func:`init` installs an exception hook: an uncaught exception on any rank prints
``vgraph.distributed: rank R of P failed: ...`` and calls ``MPI_Abort``, which ends every rank
with a non-zero exit (running ``python -m mpi4py script.py`` does the same). The library's own
collectives are non-blocking requests polled against a deadline (``timeout``, default 300 s, or
``VGRAPH_MPI_TIMEOUT``): a rank that never joins gives :class:`CollectiveTimeoutError` instead of
a hang.

**Without MPI** (mpi4py not installed, or the script not started by ``mpiexec``) :func:`init`
returns a one-rank communicator whose collectives return their input: the same script runs in one
process, with the same results as a one-process run of the plain loop.

See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from . import io as vio
from .compute import ComputeNode
from .errors import VGraphError
from .modes import int_arg
from .ops import RowSparseGrad
from .optim import Optimizer
from .virtual import VirtualGraph

__all__ = [
    "CollectiveTimeoutError",
    "Communicator",
    "DistributedError",
    "DistributedOptimizer",
    "MPICommunicator",
    "ParameterMismatchError",
    "Shard",
    "ShardedData",
    "init",
    "launched_by_mpi",
    "load_training_state",
    "map_gather",
    "sampling",
    "save_training_state",
    "shard_range",
    "sync_parameters",
]

#: Environment variables one of which every common MPI launcher sets in the processes it starts.
_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
DEFAULT_TIMEOUT = 300.0


class DistributedError(VGraphError, RuntimeError):
    """Ranks that disagree, or a collective that failed."""


class ParameterMismatchError(DistributedError):
    """The ranks' models differ: a parameter's name, shape or dtype (the message names the rank
    and the parameter). Raised on every rank, before anything is changed."""


class CollectiveTimeoutError(DistributedError, TimeoutError):
    """A collective did not complete within the communicator's timeout: some rank never joined it
    (it is stuck, or runs different code)."""


# ---------------------------------------------------------------------------- communicators


class Communicator:
    """The processes of a run and the collectives vgraph uses among them.

    :func:`init` gives the world communicator: an MPI one under ``mpiexec``, else a one-rank one
    (this class), whose collectives return their input.

    Attributes:
        rank: this process's index, ``0 .. size-1``.
        size: the number of processes.
        timeout: seconds a collective may wait for the other ranks before
            :class:`CollectiveTimeoutError`.
    """

    is_mpi = False

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.rank = 0
        self.size = 1
        self.timeout = _timeout_arg(timeout)

    def __repr__(self) -> str:
        kind = "MPI" if self.is_mpi else "one process, no MPI"
        return f"{type(self).__name__}(rank {self.rank} of {self.size}, {kind}, timeout {self.timeout:g}s)"

    def barrier(self, what: str = "barrier") -> None:
        """Wait until every rank has reached this call.

        Raises:
            CollectiveTimeoutError: not every rank arrived within :attr:`timeout`.
        """

    def allreduce_sum(
        self, arrays: Sequence[np.ndarray], what: str = "all-reduce", eager: bool = False
    ) -> list[np.ndarray]:
        """The element-wise sums over ranks of each contiguous 1-D array, all started at once.
        ``eager``: every rank is known to be here (poll without pausing).

        Raises:
            CollectiveTimeoutError: as :meth:`barrier`.
        """
        return [np.array(a) for a in arrays]

    def allgather_arrays(
        self, arrays: Sequence[np.ndarray], what: str = "all-gather", eager: bool = False
    ) -> list[list[np.ndarray]]:
        """Every rank's 1-D arrays (sizes may differ by rank), ``result[k][r]`` = rank r's
        ``arrays[k]``; the sizes are exchanged first.

        Raises:
            CollectiveTimeoutError: as :meth:`barrier`.
        """
        return [[np.array(a)] for a in arrays]

    def exchange(
        self,
        sums: Sequence[np.ndarray],
        gathers: Sequence[np.ndarray],
        sizes: Sequence[Sequence[int]],
        what: str = "exchange",
        eager: bool = True,
    ) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        """:meth:`allreduce_sum` of ``sums`` — **in place**: each array becomes its sum over
        ranks — and :meth:`allgather_arrays` of ``gathers`` (whose sizes on every rank,
        ``sizes[k][r]``, are known already) at once. ``eager``: every rank is known to be here
        (the transfer polls without pausing).

        Returns:
            ``sums`` (summed) and the gathered arrays as :meth:`allgather_arrays` gives them.

        Raises:
            CollectiveTimeoutError: as :meth:`barrier`.
        """
        return list(sums), [[np.array(a)] for a in gathers]

    def allgather(self, obj: Any, what: str = "all-gather") -> list[Any]:
        """Every rank's ``obj`` (pickled), in rank order.

        Raises:
            CollectiveTimeoutError: as :meth:`barrier`.
        """
        return [obj]

    def bcast(self, obj: Any, root: int = 0, what: str = "broadcast") -> Any:
        """Rank ``root``'s ``obj`` (pickled) on every rank.

        Raises:
            CollectiveTimeoutError: as :meth:`barrier`.
        """
        return obj

    def abort(self, code: int = 1) -> None:
        """End every rank at once with exit status ``code`` (``MPI_Abort``); one process exits."""
        os._exit(code)


class MPICommunicator(Communicator):
    """A :class:`Communicator` over an ``mpi4py`` communicator (``MPI.COMM_WORLD`` by default).

    Each collective is a non-blocking MPI request polled until it completes or :attr:`timeout`
    passes; polling sleeps between tests (up to 0.5 ms), so a waiting rank leaves the CPU to others.
    """

    is_mpi = True

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        super().__init__(timeout)
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())

    def _wait(self, requests: list[Any], what: str, eager: bool = False) -> None:
        """Test ``requests`` until all complete or the timeout passes. MPI makes progress on a
        non-blocking collective only while a rank tests it, so once every rank is known to have
        arrived (``eager``: the transfer after a completed handshake) it tests without pausing,
        yielding the CPU between tests after 0.2 ms (a peer sharing the core then runs at once);
        otherwise, after 1 ms of spinning, it sleeps between tests (10 µs doubling to 0.5 ms),
        so that a rank waiting for a slower one leaves the CPU to others."""
        Testall = self._MPI.Request.Testall
        now = time.monotonic()
        deadline = now + self.timeout
        spin_until = now + (2e-4 if eager else 1e-3)
        pause = 1e-5
        while not Testall(requests):
            now = time.monotonic()
            if now > deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.rank} of {self.size}: {what} did not complete within "
                    f"{self.timeout:g} s (timeout): another rank never joined it — it is stuck, "
                    "died, or runs different code"
                )
            if now > spin_until:
                if eager:
                    os.sched_yield()
                else:
                    time.sleep(pause)
                    pause = min(pause * 2, 5e-4)

    def barrier(self, what: str = "barrier") -> None:
        self._wait([self.comm.Ibarrier()], what)

    def allreduce_sum(
        self, arrays: Sequence[np.ndarray], what: str = "all-reduce", eager: bool = False
    ) -> list[np.ndarray]:
        MPI = self._MPI
        outs = [np.empty_like(a) for a in arrays]
        reqs = [self.comm.Iallreduce(np.ascontiguousarray(a), o, op=MPI.SUM) for a, o in zip(arrays, outs)]
        self._wait(reqs, what, eager)
        return outs

    def allgather_arrays(
        self, arrays: Sequence[np.ndarray], what: str = "all-gather", eager: bool = False
    ) -> list[list[np.ndarray]]:
        sizes = np.array([a.size for a in arrays], dtype=np.int64)
        all_sizes = np.empty((self.size, sizes.size), dtype=np.int64)
        self._wait([self.comm.Iallgather(sizes, all_sizes)], f"{what} (sizes)", eager)
        # Every rank has sent its sizes: all are here, so the transfer polls eagerly.
        return self.exchange([], arrays, all_sizes.T.tolist(), what, eager=True)[1]

    def exchange(
        self,
        sums: Sequence[np.ndarray],
        gathers: Sequence[np.ndarray],
        sizes: Sequence[Sequence[int]],
        what: str = "exchange",
        eager: bool = True,
    ) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
        MPI = self._MPI
        for a in sums:
            if not a.flags.c_contiguous:
                raise ValueError("exchange: the arrays to sum in place must be contiguous")
        reqs = [self.comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM) for a in sums]
        outs = []
        for a, counts in zip(gathers, sizes):
            counts = [int(c) for c in counts]
            displ = [sum(counts[:r]) for r in range(self.size)]
            out = np.empty(sum(counts), dtype=a.dtype)
            reqs.append(self.comm.Iallgatherv(np.ascontiguousarray(a), [out, (counts, displ)]))
            outs.append((out, counts, displ))
        self._wait(reqs, what, eager)
        return list(sums), [[out[d : d + c] for c, d in zip(counts, displ)] for out, counts, displ in outs]

    def allgather(self, obj: Any, what: str = "all-gather") -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        return [pickle.loads(part.tobytes()) for part in self.allgather_arrays([data], what)[0]]

    def bcast(self, obj: Any, root: int = 0, what: str = "broadcast") -> Any:
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        n = np.array([data.size if self.rank == root else 0], dtype=np.int64)
        self._wait([self.comm.Ibcast(n, root=root)], f"{what} (size)")
        buf = np.array(data) if self.rank == root else np.empty(int(n[0]), dtype=np.uint8)
        self._wait([self.comm.Ibcast(buf, root=root)], what, eager=True)
        return obj if self.rank == root else pickle.loads(buf.tobytes())

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


def _timeout_arg(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


_world: Communicator | None = None


def launched_by_mpi() -> bool:
    """Whether this process was started by an MPI launcher (``mpiexec``, ``srun`` …)."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def init(timeout: float | None = None, excepthook: bool = True) -> Communicator:
    """The world communicator: MPI's when launched by ``mpiexec`` with mpi4py installed, else
    one rank. Calling it again returns the same communicator (with ``timeout`` updated if given).

    Args:
        timeout: seconds any of vgraph's collectives may wait (default ``VGRAPH_MPI_TIMEOUT`` or
            300).
        excepthook: install :func:`sys.excepthook` that, on an uncaught exception, prints it
            with this rank's number and aborts every rank (``MPI_Abort``), so that an error on
            one rank never leaves the others waiting. Only under MPI.

    Returns:
        A :class:`Communicator` (an :class:`MPICommunicator` under MPI).

    Raises:
        ValueError: a timeout that is not a positive number.
        DistributedError: launched by ``mpiexec`` but mpi4py cannot be imported (a world of one
            rank would silently train each rank alone).
    """
    global _world
    if timeout is None:
        text = os.environ.get("VGRAPH_MPI_TIMEOUT", str(DEFAULT_TIMEOUT))
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"VGRAPH_MPI_TIMEOUT must be a number of seconds > 0, got {text!r}") from None
    timeout = _timeout_arg(timeout)
    if _world is not None:
        _world.timeout = timeout
        return _world
    world: Communicator
    if launched_by_mpi():
        try:
            import mpi4py  # noqa: F401
        except ImportError as e:
            raise DistributedError(
                "this process was started by an MPI launcher, but mpi4py cannot be imported "
                f"({e}); install the extra: pip install 'vgraph[mpi]'"
            ) from e
        world = MPICommunicator(timeout=timeout)
        if excepthook:
            _install_excepthook(world)
    else:
        world = Communicator(timeout)
    _world = world
    return world


def _install_excepthook(comm: Communicator) -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            text = "".join(traceback.format_exception(kind, value, tb))
            sys.stderr.write(
                f"vgraph.distributed: rank {comm.rank} of {comm.size} failed: {kind.__name__}: {value}\n"
                f"{text}vgraph.distributed: aborting every rank\n"
            )
            sys.stderr.flush()
            _drain(sys.stderr)
        finally:
            comm.abort(1)
        previous(kind, value, tb)  # only reached if abort returned

    sys.excepthook = hook


def _drain(stream: Any, limit: float = 2.0) -> None:
    """Wait (at most ``limit`` seconds) until what this process wrote to ``stream`` has been read
    from it, when it is a pipe: a launcher forwards each rank's output through a pipe, and an
    abort that ends the launcher's forwarding first loses what is still in the pipe — the very
    message saying which rank failed and why."""
    try:
        import fcntl
        import stat
        import termios

        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        deadline = time.monotonic() + limit
        unread = bytearray(4)
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, unread)
            if int.from_bytes(unread, sys.byteorder) == 0:
                return
            time.sleep(0.005)
    except (ImportError, OSError, ValueError, AttributeError):  # (no descriptor, no fcntl: do not wait)
        return


# ---------------------------------------------------------------------------- parameters


def _named(params: Sequence[ComputeNode]) -> dict[str, ComputeNode]:
    named: dict[str, ComputeNode] = {}
    for p in params:
        if not isinstance(p.name, str) or not p.name or p.name in named:
            raise DistributedError(
                f"{p.describe()}: distributed training matches parameters across ranks by name; "
                "give the optimiser a graph's parameter store (g.params) or uniquely named parameters"
            )
        named[p.name] = p
    return named


def _spec(p: ComputeNode) -> tuple[tuple[int, ...], str]:
    v = p.value
    return tuple(int(n) for n in v.shape), str(v.dtype)


def _agree(
    comm: Communicator, named: dict[str, ComputeNode], graph: VirtualGraph | None, what: str
) -> tuple[list[str], dict[str, int]]:
    """The sorted union of the ranks' parameter names after checking that every rank holding a
    name holds it with the same shape and dtype, and that every other rank's model declares it (an
    untied copy it has not built yet). Returns the names and, for each name some rank lacks, the
    lowest rank that has it.

    Raises:
        ParameterMismatchError: on every rank, naming the first rank and parameter that differ.
    """
    specs = {k: _spec(p) for k, p in named.items()}
    everyone = comm.allgather(specs, f"{what}: parameter names")
    union = sorted(set().union(*everyone))
    problems: list[str] = []
    owners: dict[str, int] = {}
    for name in union:
        holders = [r for r, s in enumerate(everyone) if name in s]
        ref = holders[0]
        for r in holders[1:]:
            if everyone[r][name] != everyone[ref][name]:
                (s0, d0), (s1, d1) = everyone[ref][name], everyone[r][name]
                problems.append(
                    f"rank {r}: parameter {name!r} has shape {s1} and dtype {d1}, but rank {ref} has "
                    f"shape {s0} and dtype {d0}"
                )
        if len(holders) < comm.size:
            owners[name] = ref
    # Each rank checks that its own model declares what it lacks; the verdicts are exchanged so
    # that every rank raises the same error.
    mine: list[str] = []
    for name in owners:
        if name in named:
            continue
        spec = graph.params.declared(name) if graph is not None else None
        shape, dtype = everyone[owners[name]][name]
        if spec is None:
            mine.append(
                f"rank {comm.rank}: has no parameter {name!r} (rank {owners[name]} has it, shape {shape}); "
                "the ranks' models differ"
                + ("" if graph is not None else " (or pass graph= to create untied copies)")
            )
        elif (tuple(spec[0]), str(spec[1])) != (shape, dtype):
            mine.append(
                f"rank {comm.rank}: declares parameter {name!r} with shape {tuple(spec[0])} and dtype "
                f"{spec[1]}, but rank {owners[name]} has shape {shape} and dtype {dtype}"
            )
    for found in comm.allgather(mine, f"{what}: checking parameters"):
        problems.extend(found)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ParameterMismatchError(
            f"{what}: the ranks' models differ: {problems[0]}{more}; nothing was changed"
        )
    return union, owners


def _take(
    named: dict[str, ComputeNode], graph: VirtualGraph | None, values: Mapping[str, np.ndarray]
) -> None:
    """Set this rank's parameters to ``values`` (received from another rank), creating in
    ``graph``'s store those it lacks (:func:`_agree` checked that it declares them)."""
    for name, value in values.items():
        if name in named:
            named[name].value = value
        elif graph is not None:
            graph.params.set_value(name, value)
            named[name] = graph.params[name]


def _fill_missing(
    comm: Communicator, named: dict[str, ComputeNode], graph: VirtualGraph | None, owners: Mapping[str, int]
) -> None:
    """Give every rank every parameter in ``owners`` with the value of its owner (lowest rank that
    has it); ranks lacking one create it in ``graph``'s store. One broadcast per owner."""
    by_owner: dict[int, list[str]] = {}
    for name, owner in owners.items():
        by_owner.setdefault(owner, []).append(name)
    for owner, names in sorted(by_owner.items()):
        mine = {k: named[k].value for k in names} if comm.rank == owner else None
        values = comm.bcast(mine, owner, f"untied copies from rank {owner}")
        if comm.rank != owner:
            _take(named, graph, values)


def sync_parameters(
    comm: Communicator,
    params: Any,
    graph: VirtualGraph | None = None,
    optimizer: Optimizer | None = None,
    root: int = 0,
) -> None:
    """Make every rank's parameters (and optimiser state) rank ``root``'s, after checking that the
    ranks' models agree.

    Every rank must call it. Parameters are matched by name; names, shapes and dtypes are checked
    on all ranks first. An untied copy (``"W@3"``) that some ranks lack is created there from
    ``graph``'s declarations.

    Args:
        comm: the communicator.
        params: the parameter nodes (``g.params.parameters()``, ``optimizer.parameters()``).
        graph: the model, to create untied copies some ranks lack.
        optimizer: its state (step counts, moments) is replaced by rank ``root``'s.
        root: the rank whose values everyone takes.

    Raises:
        ParameterMismatchError: on every rank, naming the first rank and parameter that differ;
            nothing is changed then.
        CollectiveTimeoutError: a rank did not join within the timeout.
    """
    named = _named(list(params))
    _, owners = _agree(comm, named, graph, "sync_parameters")
    values = comm.bcast(
        {k: p.value for k, p in named.items()} if comm.rank == root else None, root, "parameter values"
    )
    if comm.rank != root:
        _take(named, graph, values)  # creates the copies root has and this rank lacks
    # Each value travels once: only the copies root lacks still need their owner's.
    _fill_missing(comm, named, graph, {k: r for k, r in owners.items() if k not in values})
    if optimizer is not None:
        state = comm.bcast(optimizer.state_dict() if comm.rank == root else None, root, "optimiser state")
        if comm.rank != root:
            optimizer.load_state_dict(state)


# ---------------------------------------------------------------------------- the optimiser


_NONE, _DENSE = -1, -2  # header codes; a sparse gradient's code is its row count (>= 0)


class DistributedOptimizer:
    """A :mod:`vgraph.optim` optimiser whose step uses the gradients combined over every rank.

    At construction the parameters and the optimiser's state are broadcast from rank 0, after
    checking that every rank's model has the same parameter names, shapes and dtypes (see
    :func:`sync_parameters`). Each :meth:`step` combines the gradients (see the module docstring)
    and then steps the wrapped optimiser on every rank. Other attributes (``lr``, ``state`` …) are
    the wrapped optimiser's.

    To clip the combined gradients, call :meth:`synchronize`, then clip, then :meth:`step` (as
    with Horovod's ``DistributedOptimizer``).

    Args:
        optimizer: the optimiser to wrap (built on ``g.params`` as in one process).
        graph: the model (needed to create untied copies some ranks lack).
        comm: the communicator (default :func:`init`'s).
        count: the default ``count`` of :meth:`step` (e.g. the rank's fixed number of sequences
            when :func:`vgraph.tbptt.truncated_bptt` calls ``step()``), or ``None``: weigh each
            rank 1.
        sync: broadcast and check the parameters now (as :func:`sync_parameters`).

    Raises:
        TypeError: ``optimizer`` is not a vgraph optimiser, ``graph`` not a VirtualGraph,
            ``count`` not an int or ``None`` (:class:`~vgraph.errors.ArgumentError`).
        ArgumentValueError: a negative ``count`` (a ValueError).
        ParameterMismatchError: the ranks' models differ (on every rank, before any step).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        graph: VirtualGraph | None = None,
        comm: Communicator | None = None,
        count: int | None = None,
        sync: bool = True,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a vgraph.optim optimiser, got {type(optimizer).__name__}")
        if graph is not None and not isinstance(graph, VirtualGraph):
            raise TypeError(f"graph must be a VirtualGraph, got {type(graph).__name__}")
        self.optimizer = optimizer
        self.graph = graph
        self.comm = init() if comm is None else comm
        self.count = int_arg(count, "count", 0, optional=True)
        self._names: list[str] | None = None  # the agreed parameter names (sorted)
        self._signature = 0
        self._synced = False
        if sync:
            sync_parameters(self.comm, optimizer.parameters(), graph, optimizer)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({type(self.optimizer).__name__}, {self.comm!r})"

    @property
    def lr(self) -> float:
        """The wrapped optimiser's learning rate (setting it sets theirs)."""
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    def parameters(self) -> list[ComputeNode]:
        """The wrapped optimiser's parameters."""
        return self.optimizer.parameters()

    def zero_grad(self) -> None:
        """Clear every parameter's ``.grad`` (the wrapped optimiser's)."""
        self.optimizer.zero_grad()
        self._synced = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimiser's state dict (the same on every rank)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> list[str]:
        """Load into the wrapped optimiser (see :meth:`vgraph.optim.Optimizer.load_state_dict`)."""
        return self.optimizer.load_state_dict(state_dict, strict)

    def synchronize(self, count: int | None = None) -> None:
        """Replace every parameter's ``.grad`` by the combination over ranks (see the module
        docstring); every rank must call it. :meth:`step` calls it unless it was called since the
        last step.

        Args:
            count: the number of examples (or tokens) this rank's loss is a mean over; the
                result is the gradient of the mean over all ranks' examples. ``None``: the
                default given at construction, or weight 1 for every rank.

        Raises:
            ArgumentError: ``count`` is not an int (a TypeError). ArgumentValueError: it is
                negative (a ValueError); nothing is communicated then.
            DistributedError: some ranks passed ``count`` and others did not, or gradients
                exist but the counts add up to 0.
            ParameterMismatchError: the ranks' parameters differ (see :func:`sync_parameters`).
            CollectiveTimeoutError: a rank did not join within the timeout.
        """
        count = self.count if count is None else int_arg(count, "count", 0)
        comm = self.comm
        if comm.size == 1:  # one rank: the gradients are the combination (bit for bit)
            self._synced = True
            return
        named = _named(self.optimizer.parameters())
        local = sorted(named)
        signature = _signature(local)
        header = self._header(named, signature, count)
        rows = self._exchange_header(header)
        if self._names is None or any(r[0] != self._signature for r in rows):
            names, owners = _agree(comm, named, self.graph, "DistributedOptimizer.step")
            _fill_missing(comm, named, self.graph, owners)
            self._names, self._signature = names, _signature(names)
            header = self._header(named, self._signature, count)
            rows = self._exchange_header(header)
        table = np.stack(rows)  # (ranks, 3 + parameters)
        if len(set(table[:, 1].tolist())) > 1:
            given = [r for r in range(comm.size) if table[r, 1]]
            raise DistributedError(
                f"ranks {given} passed count= to step() and the others did not; pass it on every rank"
            )
        total = int(table[:, 2].sum())
        codes = table[:, 3:]
        assert self._names is not None
        params = [named[k] for k in self._names]
        if total == 0:
            if (codes != _NONE).any():
                raise DistributedError("step(count=0) on every rank, but some ranks have gradients")
            self._synced = True
            return
        weight = int(table[comm.rank, 2])  # a Python int keeps float32 gradients float32
        dense: dict[str, list[int]] = {}
        sparse: dict[str, list[int]] = {}
        for i, p in enumerate(params):
            col = codes[:, i]
            if (col == _NONE).all():
                continue
            group = dense if (col == _DENSE).any() else sparse
            group.setdefault(str(p.value.dtype), []).append(i)
        sends = []
        for idx in dense.values():  # one flat buffer per dtype, filled in place
            buf = np.empty(sum(params[i].value.size for i in idx), dtype=params[idx[0]].value.dtype)
            at = 0
            for i in idx:
                n = params[i].value.size
                _fill_dense(params[i], weight, buf[at : at + n])
                at += n
            sends.append(buf)
        gathers: list[np.ndarray] = []
        sizes: list[list[int]] = []
        widths = {i: int(np.prod(params[i].value.shape[1:])) for idx in sparse.values() for i in idx}
        for dt, idx in sparse.items():
            own = [_sparse_grad(params[i], weight) for i in idx]
            rows_per_rank = np.maximum(codes[:, idx], 0)  # (ranks, parameters of this group)
            gathers.append(np.concatenate([rows for rows, _ in own]))
            gathers.append(np.concatenate([vals.ravel() for _, vals in own]).astype(dt, copy=False))
            sizes.append(rows_per_rank.sum(axis=1).tolist())
            sizes.append((rows_per_rank * [widths[i] for i in idx]).sum(axis=1).tolist())
        # The header exchange was the handshake: every rank is here, so the transfer polls eagerly.
        summed, gathered = comm.exchange(sends, gathers, sizes, "gradient exchange")  # sends, summed
        for idx, summed_flat in zip(dense.values(), summed):
            summed_flat /= total
            at = 0
            for i in idx:
                p = params[i]
                n = p.value.size
                p.grad = summed_flat[at : at + n].reshape(p.value.shape)
                at += n
        for k, idx in enumerate(sparse.values()):
            all_rows, all_vals = gathered[2 * k], gathered[2 * k + 1]
            parts: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {i: ([], []) for i in idx}
            for r in range(comm.size):
                row_at = val_at = 0
                for i in idx:
                    n = max(int(codes[r, i]), 0)
                    parts[i][0].append(all_rows[r][row_at : row_at + n])
                    parts[i][1].append(all_vals[r][val_at : val_at + n * widths[i]])
                    row_at += n
                    val_at += n * widths[i]
            for i in idx:
                shape = params[i].value.shape
                at_rows = np.concatenate(parts[i][0])
                at_vals = np.concatenate(parts[i][1]).reshape(at_rows.size, *shape[1:])
                coalesced = RowSparseGrad(at_rows, at_vals, shape)  # rows summed in rank order
                params[i].grad = coalesced.with_values(coalesced.values / total)
        for i, p in enumerate(params):
            if (codes[:, i] == _NONE).all():
                p.grad = None
        self._synced = True

    def _exchange_header(self, header: np.ndarray) -> list[np.ndarray]:
        """Every rank's header: one all-gather of a size every rank knows (the agreed names'), so
        a single round trip; it waits for the slowest rank (polling with pauses)."""
        sizes = [[header.size] * self.comm.size]
        return self.comm.exchange([], [header], sizes, "gradient header", eager=False)[1][0]

    def _header(self, named: Mapping[str, ComputeNode], signature: int, count: int | None) -> np.ndarray:
        names = self._names if self._names is not None else []
        header = np.empty(3 + len(names), dtype=np.int64)
        header[0] = signature
        header[1] = count is not None
        header[2] = 1 if count is None else count
        for k, name in enumerate(names):
            p = named.get(name)
            g = None if p is None else p.grad
            header[3 + k] = _NONE if g is None else g.indices.size if isinstance(g, RowSparseGrad) else _DENSE
        return header

    def step(self, count: int | None = None) -> None:
        """Combine the gradients over ranks (unless :meth:`synchronize` was just called) and step
        the wrapped optimiser. Every rank must call it.

        Args:
            count: as :meth:`synchronize`.

        Raises:
            as :meth:`synchronize` and the wrapped optimiser's ``step``.
        """
        if not self._synced:
            self.synchronize(count)
        self._synced = False
        self.optimizer.step()


def _signature(names: Sequence[str]) -> int:
    digest = hashlib.blake2b("\0".join(names).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _fill_dense(p: ComputeNode, weight: int, out: np.ndarray) -> None:
    """Write ``weight`` times the parameter's gradient (zeros if it has none), flat, into ``out``."""
    g = p.grad
    if g is None:
        out[...] = 0
        return
    arr = np.asarray(g).reshape(-1)
    if weight != 1:
        np.multiply(arr, weight, out=out, casting="unsafe")
    else:
        out[...] = arr


def _sparse_grad(p: ComputeNode, weight: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows and ``weight`` times the values of a row-sparse gradient (none if ``.grad`` is
    ``None``), values in the parameter's dtype."""
    g = p.grad
    shape = p.value.shape
    if g is None:
        return np.zeros(0, np.int64), np.zeros((0, *shape[1:]), dtype=p.value.dtype)
    assert isinstance(g, RowSparseGrad)
    vals = g.values.astype(p.value.dtype, copy=False)
    return g.indices, vals * weight if weight != 1 else vals


# ---------------------------------------------------------------------------- data


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous share of ``total`` items split over ``size``
    ranks: ``start = rank * total // size``. Shares differ by at most one item; with fewer items
    than ranks some shares are empty. The shares cover ``0 .. total`` once, in rank order."""
    return rank * total // size, (rank + 1) * total // size


@dataclass
class Shard:
    """This rank's part of one global minibatch.

    Attributes:
        items: the examples (``data[i]`` for ``i`` in ``indices``).
        indices: their indices into the data set.
        offset: the position of this rank's first example in the global minibatch.
        count: ``len(items)`` (pass it to :meth:`DistributedOptimizer.step`).
        total: the size of the global minibatch (every rank's ``count`` summed).
        step: the index of the minibatch in its epoch.
    """

    items: list[Any]
    indices: np.ndarray
    offset: int
    count: int
    total: int
    step: int


class ShardedData:
    """Each rank's share of a data set, epoch by epoch, the same order on every rank.

    Epoch ``e`` orders the data by ``numpy.random.default_rng([seed, e]).permutation(len(data))``
    (the identity with ``shuffle=False``) — the same on every rank and for any number of ranks.
    :meth:`batches` cuts that order into global minibatches of ``batch_size`` (the last one
    smaller, unless ``drop_last``) and gives this rank a contiguous slice of each
    (:func:`shard_range`: sizes differ by at most one, and a rank may get none when a minibatch has
    fewer examples than there are ranks). :meth:`indices` gives a rank its share of the whole
    epoch the same way. Every example is used once per epoch across the ranks.

    With ``cost`` (e.g. ``len``: a sequence's length, a tree's node count), each minibatch is
    first rearranged so that the ranks' contiguous parts also have about equal cost: the ranks
    keep the counts above, and the examples, by decreasing cost (ties in minibatch order), each go
    to the rank with the least cost so far that has room (ties to the lowest rank); the minibatch
    is then reordered rank by rank, each rank's examples in their minibatch order. Every rank computes the same arrangement, so a
    step waits less for the slowest rank; the gradient is the same (pass ``count=shard.count``).

    Args:
        data: a sequence of examples (anything with ``len`` and ``[i]``).
        comm: the communicator (default :func:`init`'s).
        batch_size: examples per global minibatch (over all ranks).
        seed: the shared seed of the shuffle.
        shuffle: shuffle each epoch.
        drop_last: drop the last, smaller minibatch of an epoch.
        cost: ``cost(example) -> number``, to balance the ranks' work in each minibatch (see
            above); ``None``: equal counts.

    Raises:
        ArgumentValueError: ``batch_size`` < 1 or a negative ``seed`` (a ValueError).
        TypeError: ``cost`` is not callable; ``batch_size`` or ``seed`` not an int
            (:class:`~vgraph.errors.ArgumentError`).
    """

    def __init__(
        self,
        data: Sequence[Any],
        comm: Communicator | None = None,
        batch_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        cost: Callable[[Any], float] | None = None,
    ) -> None:
        if cost is not None and not callable(cost):
            raise TypeError(f"cost must be a function of an example, got {type(cost).__name__}")
        self.batch_size = int_arg(batch_size, "batch_size", 1)
        self.seed = int_arg(seed, "seed", 0)
        self.data = data
        self.comm = init() if comm is None else comm
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.cost = cost

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the whole data set (the same on every rank)."""
        n = len(self.data)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __len__(self) -> int:
        """The number of global minibatches per epoch."""
        n = len(self.data)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def batches(self, epoch: int, start: int = 0) -> Iterator[Shard]:
        """This rank's :class:`Shard` of each global minibatch of epoch ``epoch``, from minibatch
        ``start`` on (to resume mid-epoch). Every rank gets the same number of shards (some may be
        empty: call ``step(count=0)`` for them)."""
        order = self.order(epoch)
        comm = self.comm
        for step in range(start, len(self)):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            if self.cost is None:
                lo, hi = shard_range(len(batch), comm.rank, comm.size)
            else:
                batch, bounds = self._balanced(batch)
                lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
            idx = batch[lo:hi]
            yield Shard([self.data[int(i)] for i in idx], idx, lo, hi - lo, len(batch), step)

    def _balanced(self, batch: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The minibatch rearranged rank by rank with balanced costs, and each rank's bounds."""
        assert self.cost is not None
        size = self.comm.size
        costs = [float(self.cost(self.data[int(i)])) for i in batch]
        room = [hi - lo for lo, hi in (shard_range(len(batch), r, size) for r in range(size))]
        loads = [0.0] * size
        owner = [0] * len(batch)
        for k in sorted(range(len(batch)), key=lambda k: -costs[k]):  # stable: ties in order
            r = min((r for r in range(size) if room[r]), key=lambda r: loads[r])
            owner[k] = r
            loads[r] += costs[k]
            room[r] -= 1
        parts = [[i for k, i in enumerate(batch) if owner[k] == r] for r in range(size)]
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + len(part))
        return np.array([i for part in parts for i in part], dtype=batch.dtype), bounds

    def indices(self, epoch: int) -> np.ndarray:
        """This rank's contiguous share of epoch ``epoch``'s order (:func:`shard_range`)."""
        order = self.order(epoch)
        lo, hi = shard_range(len(order), self.comm.rank, self.comm.size)
        return order[lo:hi]


@contextlib.contextmanager
def sampling(graph: VirtualGraph, shard: Shard) -> Iterator[None]:
    """Draw this rank's random masks (dropout, ``g.sample``) as one process would for the whole
    minibatch.

    A graph draws the sampled nodes of its ``n``-th build (or of input ``n`` of a batched build)
    from ``(seed, n)``. Inside the block the counter starts at its value plus ``shard.offset``;
    on leaving it is set to its value plus ``shard.total`` on every rank. So masks differ across
    ranks, are reproducible from the seed, and — when the block builds the shard's examples in
    order, one build each or one :meth:`~vgraph.virtual.VirtualGraph.build_batch` — are the masks
    a single process building the whole minibatch the same way would draw.
    """
    base = graph.build_count
    graph.build_count = base + shard.offset  # the build counter is the one seed of sampled nodes
    try:
        yield
    finally:
        graph.build_count = base + shard.total


# ---------------------------------------------------------------------------- inference


def map_gather(
    fn: Callable[[Any], Any], data: Sequence[Any], comm: Communicator | None = None, root: int | None = None
) -> list[Any] | None:
    """``[fn(x) for x in data]`` computed across ranks, in ``data``'s order.

    Rank ``r`` computes the contiguous share :func:`shard_range` gives it; the results (pickled)
    are gathered in order.

    Args:
        fn: the per-example function (e.g. a build in evaluation mode and its output's value).
        data: the examples (the same on every rank).
        comm: the communicator (default :func:`init`'s).
        root: only this rank gets the list (the others get ``None``); ``None``: every rank does.

    Returns:
        The outputs of every example, in order.

    Raises:
        CollectiveTimeoutError: a rank did not join within the timeout (e.g. one failed).
    """
    comm = init() if comm is None else comm
    lo, hi = shard_range(len(data), comm.rank, comm.size)
    mine = [fn(data[i]) for i in range(lo, hi)]
    parts = comm.allgather(mine, "map_gather")
    if root is not None and comm.rank != root:
        return None
    return [y for part in parts for y in part]


# ---------------------------------------------------------------------------- checkpoints


def _unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer


def save_training_state(
    comm: Communicator,
    graph: VirtualGraph,
    path: str | os.PathLike[str],
    optimizer: Any = None,
    **kwargs: Any,
) -> None:
    """Rank 0 writes the training state (:func:`vgraph.io.save_training_state`, atomically); every
    rank returns once it is written. Every rank must call it.

    Args:
        comm: the communicator.
        graph, path, optimizer: as :func:`vgraph.io.save_training_state` (a
            :class:`DistributedOptimizer` is unwrapped).
        **kwargs: ``scheduler``, ``step``, ``rng``, ``extras``, as there.

    Raises:
        as :func:`vgraph.io.save_training_state` (on rank 0, which then aborts the run through
        the exception hook). CollectiveTimeoutError: rank 0 did not finish within the timeout.
    """
    if comm.rank == 0:
        vio.save_training_state(graph, path, _unwrap(optimizer), **kwargs)
    comm.barrier("save_training_state")


def load_training_state(
    comm: Communicator,
    graph: VirtualGraph,
    path: str | os.PathLike[str],
    optimizer: Any = None,
    **kwargs: Any,
) -> int | None:
    """Every rank loads the training state (:func:`vgraph.io.load_training_state`; the file must be
    readable by every rank, e.g. on a shared file system), then the parameters and the optimiser
    state are broadcast from rank 0 and checked (:func:`sync_parameters`). Works with any number of
    ranks, whatever the number that saved it.

    Returns:
        The saved ``step``.

    Raises:
        as :func:`vgraph.io.load_training_state` and :func:`sync_parameters`.
    """
    inner = _unwrap(optimizer)
    step = vio.load_training_state(graph, path, inner, **kwargs)
    params = inner.parameters() if inner is not None else graph.params.parameters()
    sync_parameters(comm, params, graph, inner)
    return step
