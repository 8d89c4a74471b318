"""Smoke test of the rendering benchmark (tools/bench_render.py): it runs on tiny sizes and
writes every field. No timing is asserted (the machine is shared and noisy)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_render import require_dot

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_render", ROOT / "tools" / "bench_render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_render_runs_and_reports_every_case(bench, tmp_path, capsys):
    require_dot()
    out = tmp_path / "render.json"
    assert bench.main(["--steps", "3", "8", "--folded", "40", "--timeout", "120", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["unfolded 3", "unfolded 8", "folded 40"]
    for r in rows:
        assert r["dot_s"] is not None and r["total_s"] >= r["to_dot_s"] >= 0
        assert r["drawn_nodes"] > 0 and r["drawn_edges"] > 0
    assert rows[0]["graph_nodes"] < rows[1]["graph_nodes"] < rows[2]["graph_nodes"]
    assert rows[2]["drawn_nodes"] < rows[2]["graph_nodes"]  # folded
    assert "target" in capsys.readouterr().out
