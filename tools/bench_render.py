#!/usr/bin/env python3
"""Rendering benchmark: how long drawing an unrolled graph takes, DOT extraction and ``dot`` layout.

Cases (the Elman RNN of ``examples/models/elman_rnn.py``, after ``retain_all_grads`` and one
backward, drawn with ``gradients=True`` as the CLI's ``--gradients`` does):

* ``unfolded T``: every iteration drawn (``fold=None``) for T in ``--steps`` (default 12 20 30 100).
  Target (issue 13): 100 unfolded steps laid out by ``dot`` in under 10 s.
* ``folded T``: the default fold (first 3, last 3 iterations) of a ``--folded`` (default 10,000)
  step build. Target: under 2 s from the built graph to the SVG (extraction and layout).

For each case: the graph's node count, the drawn nodes and edges, ``to_dot`` time (pure Python),
``dot -Tsvg`` time (Graphviz layout and SVG output) and their sum. A ``dot`` run longer than
``--timeout`` seconds is stopped and reported as such. Times are wall-clock on a shared machine:
run it on a quiet one, several times.

Usage::

    PYTHONPATH=. python3 tools/bench_render.py [--steps 12 20 30 100] [--folded 10000]
                                               [--timeout 120] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vgraph import render as R  # noqa: E402  (after the sys.path line above)

UNFOLDED_TARGET_S = 10.0
FOLDED_TARGET_S = 2.0


def load_model(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(
        f"model_{name}", ROOT / "examples" / "models" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def built_rnn(steps: int) -> Any:
    """The Elman RNN built over ``steps`` steps, after backward with every gradient retained."""
    g, feed, outputs = load_model("elman_rnn").build(steps=steps)
    cg = g.build(feed, outputs)
    R.retain_all_grads(cg)
    cg.backward(cg.outputs[0])
    return cg


def measure(cg: Any, timeout: float, **options: Any) -> dict[str, Any]:
    """Time ``to_dot`` and ``dot -Tsvg`` for one drawing of ``cg``."""
    t0 = time.perf_counter()
    text = R.to_dot(cg, **options)
    t_extract = time.perf_counter() - t0
    lines = text.splitlines()
    edges = sum(1 for s in lines if " -> " in s)
    nodes = sum(1 for s in lines if s.lstrip().startswith('"') and " -> " not in s)
    # (the graph drawn: node by node, also where loops ran as body programs)
    row: dict[str, Any] = {"graph_nodes": len(cg.per_node()), "drawn_nodes": nodes, "drawn_edges": edges,
                           "to_dot_s": round(t_extract, 4)}  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [shutil.which("dot") or "dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        row.update(dot_s=None, total_s=None, note=f"dot stopped after {timeout:g} s")
        return row
    t_dot = time.perf_counter() - t0
    if proc.returncode != 0:
        row.update(dot_s=None, total_s=None, note="dot failed: " + proc.stderr.decode(errors="replace")[:200])
        return row
    row.update(dot_s=round(t_dot, 3), total_s=round(t_extract + t_dot, 3))
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[12, 20, 30, 100],
                        help="unfolded cases: numbers of steps (default 12 20 30 100)")  # fmt: skip
    parser.add_argument("--folded", type=int, default=10_000, help="steps of the folded case (default 10000)")
    parser.add_argument("--timeout", type=float, default=120.0, help="stop a dot run after this many seconds")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if not R.dot_available():
        print("Graphviz's `dot` is not installed: nothing to measure", file=sys.stderr)
        return 2
    version = subprocess.run(["dot", "-V"], capture_output=True, text=True).stderr.strip()
    print(f"{version}\n")
    header = f"{'case':<16}{'nodes':>8}{'drawn':>8}{'edges':>8}{'to_dot s':>10}{'dot s':>10}{'total s':>10}  target"
    print(header)
    print("-" * len(header))
    rows = []
    cases = [
        (f"unfolded {T}", T, {"fold": None}, UNFOLDED_TARGET_S if T == 100 else None) for T in args.steps
    ]
    cases.append((f"folded {args.folded}", args.folded, {}, FOLDED_TARGET_S))
    for name, steps, options, target in cases:
        cg = built_rnn(steps)
        row = {"case": name, "steps": steps, **measure(cg, args.timeout, gradients=True, **options)}
        if target is not None:
            row["target_s"] = target
            row["pass"] = row["total_s"] is not None and row["total_s"] < target
        rows.append(row)
        dot_s = "-" if row["dot_s"] is None else f"{row['dot_s']:.3f}"
        total = "-" if row["total_s"] is None else f"{row['total_s']:.3f}"
        verdict = "" if target is None else f"< {target:g} s: {'PASS' if row['pass'] else 'FAIL'}"
        print(f"{name:<16}{row['graph_nodes']:>8}{row['drawn_nodes']:>8}{row['drawn_edges']:>8}"
              f"{row['to_dot_s']:>10.3f}{dot_s:>10}{total:>10}  {verdict} {row.get('note', '')}")  # fmt: skip
        sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "render", "graphviz": version, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
