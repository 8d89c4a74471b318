"""Failure behaviour under ``mpiexec -n 2``: ``python tests/mpi_scripts/failures.py MODE``.

* ``raise``: rank 1 raises an exception while rank 0 waits in a collective.
* ``kill``: rank 1 is killed by SIGKILL while rank 0 waits in a collective.
* ``timeout``: rank 1 never joins rank 0's collective (the timeout is 1 s).
* ``mismatch``: rank 1's model declares a parameter with another shape.
* ``count``: rank 0 steps with ``count=``, rank 1 without.

Every mode must end both ranks with a non-zero exit within seconds; none may hang.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import vgraph as vg
from vgraph import distributed as dist
from vgraph import optim


def main() -> None:
    mode = sys.argv[1]
    comm = dist.init(timeout=1.0 if mode == "timeout" else 60.0)
    if mode == "mismatch":
        g = vg.VirtualGraph(dtype=np.float64)
        g.parameter("W", (3, 2 if comm.rank == 0 else 4))
        dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g, comm)
        return
    if mode == "count":
        g = vg.VirtualGraph(dtype=np.float64)
        W = g.parameter("W", (3, 2))
        opt = dist.DistributedOptimizer(optim.SGD(g.params, lr=0.1), g, comm)
        loss = vg.sum(W * W)
        g.build({}, loss).backward(loss)
        opt.step(count=3) if comm.rank == 0 else opt.step()
        return
    if comm.rank == 1:
        if mode == "raise":
            raise ValueError("boom on purpose")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "timeout":
            time.sleep(30)
            return
    comm.barrier("the test's barrier")
    time.sleep(30)  # rank 0 never gets here unless rank 1 joined


if __name__ == "__main__":
    main()
