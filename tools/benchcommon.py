"""What the benchmarks in tools/ share. Importing it must not import numpy (see
:func:`pin_blas_threads`)."""

from __future__ import annotations

import os
import sys

#: The environment variables that set how many threads BLAS (OpenBLAS, MKL, OpenMP) runs.
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pin_blas_threads() -> None:
    """Run BLAS single-threaded unless told otherwise (``--blas-threads N`` or the usual env vars).

    Must run before numpy is imported. On small shared machines multi-threaded OpenBLAS turns
    sub-millisecond matmuls into 10-100x outliers (threads spinning against other processes), which
    makes medians of both vgraph and numpy meaningless; one thread is stable and, for these sizes,
    as fast or faster. Only call it when a benchmark runs as a script.
    """
    n = None
    for i, a in enumerate(sys.argv):
        if a == "--blas-threads" and i + 1 < len(sys.argv):
            n = sys.argv[i + 1]
        elif a.startswith("--blas-threads="):
            n = a.split("=", 1)[1]
    for var in BLAS_VARS:
        if n is not None:
            os.environ[var] = n
        else:
            os.environ.setdefault(var, "1")
