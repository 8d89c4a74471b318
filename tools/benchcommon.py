"""What the benchmarks in tools/ share. Importing it must not import numpy (see
:func:`pin_blas_threads`)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

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


#: The line a benchmark prints when its PyTorch columns cannot run.
TORCH_MISSING = (
    "PyTorch columns skipped: torch is not installed (pip install torch==2.13.0, the 'bench' extra)"
)


def load_torch(enabled: bool = True) -> Any:
    """PyTorch set to one intra-op and one inter-op thread (as BLAS, :func:`pin_blas_threads`),
    or ``None`` when it is not installed or ``enabled`` is false (``--no-torch``).

    Imported only when asked for: the benchmarks run without it, and importing it takes seconds.
    """
    if not enabled:
        return None
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set, or inter-op work already ran
        torch.set_num_interop_threads(1)
    return torch
