"""Smoke test of the performance benchmark (tools/bench_rnn.py).

Checks that the benchmark still measures the right thing: vgraph's BPTT gradients and loss equal the
hand-written numpy references (both vgraph modes), a wrong reference is caught, and a ``--quick``
run writes a JSON report with every expected field. No timing is asserted: numbers depend on the
machine and its load.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench_rnn.py"
SMALLEST = (8, 32, 16, 50)
PARAMS = {"Wx", "Wh", "b", "Wo"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_rnn", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gradients_match_the_numpy_reference(bench):
    report = bench.check_correctness(SMALLEST)
    for key in ("rebuild_max_abs_err", "reuse_max_abs_err", "numpy_batched_max_abs_err"):
        assert set(report[key]) == PARAMS
        assert all(err <= 1e-4 for err in report[key].values()), report[key]
    assert math.isfinite(report["loss"])
    # reuse mode really recomputed the graph after new inputs and parameters
    assert 0 < report["reuse_recomputed"] <= report["reuse_visited"]


def test_a_wrong_reference_gradient_is_caught(bench, monkeypatch):
    right = bench.numpy_grads

    def off_by_one_percent(P, x, y):
        loss, grads = right(P, x, y)
        return loss, {**grads, "Wh": grads["Wh"] * 1.01}

    monkeypatch.setattr(bench, "numpy_grads", off_by_one_percent)
    with pytest.raises(bench.BenchmarkMismatch, match="Wh"):
        bench.check_correctness(SMALLEST)


def test_quick_json_run(tmp_path):
    out = tmp_path / "bench.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    size = ",".join(map(str, SMALLEST))
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--sizes", size, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr  # failing targets do not fail without --strict
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout  # the table was printed
    data = json.loads(out.read_text())

    assert {"benchmark", "date", "machine", "config", "correctness", "training", "extras", "all_pass"} <= set(
        data
    )
    machine = data["machine"]
    for key in ("platform", "python", "numpy", "cpu_count"):
        assert machine[key], key
    assert data["config"]["quick"] is True and data["config"]["sizes"] == [list(SMALLEST)]

    rows = data["training"]
    assert sorted(r["mode"] for r in rows) == ["rebuild", "reuse"]
    for r in rows:
        assert r["size"] == list(SMALLEST)
        for impl in ("vgraph", "numpy", "numpy_batched"):
            assert r[impl]["median_ms"] > 0 and len(r[impl]["times_ms"]) == r["repeats"]
        assert r["ratio"] == pytest.approx(r["vgraph"]["median_ms"] / r["numpy"]["median_ms"])
        assert r["target"] == {"reuse": 3.0, "rebuild": 4.0}[r["mode"]]
        assert isinstance(r["pass"], bool) and r["nodes"] > 0

    extras = data["extras"]
    assert extras["unroll"]["nodes"] > 0 and extras["unroll"]["nodes_per_s"] > 0
    inc = extras["incremental"]
    assert inc["one_changed_ms"] > 0 and inc["all_changed_ms"] > 0
    assert (
        0
        < inc["one_changed"]["recomputed"]
        < inc["all_changed"]["recomputed"]
        == inc["all_changed"]["visited"]
    )
    assert inc["none_changed"]["recomputed"] == 0
    mem = extras["memory"]
    assert mem["peak_bytes"] > 0 and mem["kept_value_bytes"] > 0
    assert mem["ratio"] == pytest.approx(mem["peak_bytes"] / mem["kept_value_bytes"])
