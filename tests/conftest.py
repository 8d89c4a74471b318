"""Hypothesis profiles for the property-based tests (tests/test_properties.py).

* ``fast`` (the default, what CI runs): few examples, derandomized, so every run tries the same
  inputs and a failure reproduces exactly; no example database is written.
* ``slow`` (alias ``ci-long``): many more examples and random seeds, for a long local or nightly
  run: ``HYPOTHESIS_PROFILE=slow python -m pytest tests/test_properties.py``.

Select one with the environment variable ``HYPOTHESIS_PROFILE``. No profile has a deadline: the
machines this runs on are shared and noisy, and a test must never fail on timing.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import vgraph as vg

_COMMON = {
    "deadline": None,
    "print_blob": True,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

settings.register_profile("fast", max_examples=40, derandomize=True, database=None, **_COMMON)
settings.register_profile("slow", max_examples=600, stateful_step_count=60, database=None, **_COMMON)
settings.register_profile("ci-long", parent=settings.get_profile("slow"))

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))


@pytest.fixture
def float64():
    """Float64 as the default dtype for the test (identity tests compare to 1e-12), restored after."""
    previous = vg.get_default_dtype()
    vg.set_default_dtype(np.float64)
    yield
    vg.set_default_dtype(previous)


@pytest.fixture
def per_node():
    """Builds run every loop node by node (the reference path; ``vg.body_programs(False)``): for
    the tests of what that path does (hoisting, resizing cached graphs, compiled sweeps, …)."""
    with vg.body_programs(False):
        yield


@pytest.fixture
def defop():
    """``vg.defop`` that removes the ops it added after the test (the op table is global)."""
    added: list[str] = []

    def define(name, *args, **kwargs):
        f = vg.defop(name, *args, **kwargs)
        added.append(name)
        return f

    yield define
    for name in added:
        if name in vg.ops.OPS:
            vg.undefop(name)
