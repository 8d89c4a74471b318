"""Smoke test of tools/bench_gap.py, which splits the RNN benchmark's gap to the floor into what
vgraph's operations cost and what its bookkeeping costs.

The split is only as good as its model of vgraph's operations, so the model is checked against
vgraph itself: on one batch its gradients must equal the ones vgraph's backward gives, bit for bit,
in each regime vgraph's sweep chooses by size (gradient rows below and from ``ops.ROW_VJP_MIN``
elements, the transposed weight below and from ``ops.TRANSPOSED_MIN_WORK``). A change to what
vgraph computes that the tool does not follow fails here. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from vgraph import ops

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gap():
    spec = importlib.util.spec_from_file_location("bench_gap", ROOT / "tools" / "bench_gap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(ROOT / "tools"))  # (the tool puts its directory first, to import bench_rnn)


@pytest.mark.parametrize(
    "size",
    [
        (4, 8, 3, 5),  # 24 elements a row: tanh gradients as new arrays, stacked; W_h.T as is
        (4, 32, 32, 6),  # 1,024 elements a row: tanh gradients into one buffer
        (3, 64, 16, 4),  # 16 * 64 * 64 = 65,536 multiply-adds: W_h.T copied from its second use
        (2, 8, 2, 1),  # one step: no second use of anything
    ],
)
def test_the_operations_are_vgraphs_own(gap, size):
    I, H, B, T = size
    assert (B * H >= ops.ROW_VJP_MIN) == (size[1:3] in [(32, 32), (64, 16)])
    assert (B * H * H >= ops.TRANSPOSED_MIN_WORK) == (size == (3, 64, 16, 4))
    assert gap.check(size) == 0.0  # (and agree with the floor: check raises otherwise)


def test_a_wrong_model_is_caught(gap, monkeypatch):
    backward = gap.OperationsTrainer.backward

    def wrong(self):
        backward(self)
        self.grads["Wh"] = self.grads["Wh"] * 1.01

    monkeypatch.setattr(gap.OperationsTrainer, "backward", wrong)
    with pytest.raises(gap.br.BenchmarkMismatch, match="Wh"):
        gap.check((4, 8, 3, 5))


def test_a_run_writes_every_number(gap, tmp_path, capsys):
    out = tmp_path / "gap.json"
    assert gap.main(["--sizes", "4,8,3,5", "--repeats", "2", "--warmup", "1", "--json", str(out)]) == 0
    assert "(4,8,3,5)" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]
    assert row["size"] == [4, 8, 3, 5] and row["max_grad_diff_vs_vgraph"] == 0.0
    for name in ("floor", "operations", "vgraph"):
        phases = [row[f"{name}_{p}_ms"] for p in ("forward", "backward", "update")]
        assert all(t > 0 for t in phases)
        assert row[f"{name}_ms"] == pytest.approx(sum(phases), rel=0.5)  # medians of sums vs sums of medians
    assert row["ratio"] == pytest.approx(row["vgraph_ms"] / row["floor_ms"])
    assert np.isfinite(row["bookkeeping_backward_us_per_step"])
