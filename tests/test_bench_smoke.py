"""Smoke test of the performance benchmark (tools/bench_rnn.py).

Checks that the benchmark still measures the right thing: the tight numpy floor's gradients equal
finite differences (float64) and the per-step reference's, whatever the sequence lengths; vgraph's
BPTT gradients and loss equal the floor's (both vgraph modes); a wrong reference is caught; and a
``--quick`` run writes a JSON report with every expected field. No timing is asserted: numbers depend on the
machine and its load.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_TORCH = importlib.util.find_spec("torch") is not None
BENCH = ROOT / "tools" / "bench_rnn.py"
SMALLEST = (8, 32, 16, 50)
PARAMS = {"Wx", "Wh", "b", "Wo"}


def _tool(path: Path) -> Iterator[Any]:
    """A module-scoped fixture's body: the tool at ``path`` imported under its own name (dataclasses
    look their module up while the class is made), removed from ``sys.modules`` after."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(path.stem, None)


def _run_tool(
    path: Path, *args: str, out: Path, hide_torch: Path | None = None, timeout: int = 300
) -> tuple[str, Any]:
    """Run a benchmark tool as a user would (``python tools/….py ARGS --json OUT``) with this
    checkout on the path (and, with ``hide_torch``, a ``torch`` that cannot be imported: see
    :func:`_hidden_torch`); it must succeed. Returns its printed output and its JSON."""
    paths = [str(hide_torch)] if hide_torch is not None else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [*paths, str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(path), *args, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def _hidden_torch(tmp_path: Path) -> Path:
    """A directory whose ``torch`` package raises ImportError: first on the path, it hides torch."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torch hidden by the test')\n")
    return fake.parent


@pytest.fixture(scope="module")
def bench():
    yield from _tool(BENCH)


def test_gradients_match_the_numpy_reference(bench):
    report = bench.check_correctness(SMALLEST)
    for key in ("rebuild_max_abs_err", "reuse_max_abs_err", "numpy_perstep_max_abs_err"):
        assert set(report[key]) == PARAMS
        assert all(err <= 1e-4 for err in report[key].values()), report[key]
    assert math.isfinite(report["loss"])
    # reuse mode really recomputed the graph after new inputs and parameters
    assert 0 < report["reuse_recomputed"] <= report["reuse_visited"]


def _float64_params(rng, I, H):
    return {
        "Wx": rng.standard_normal((I, H)) * 0.5,
        "Wh": rng.standard_normal((H, H)) * 0.3,
        "b": rng.standard_normal(H) * 0.1,
        "Wo": rng.standard_normal((H, 4)) * 0.5,
    }


def test_the_tight_floor_equals_finite_differences(bench):
    rng = np.random.default_rng(0)
    I, H, B, T = 3, 4, 2, 5
    P = _float64_params(rng, I, H)
    x, y = rng.standard_normal((T, B, I)), rng.standard_normal((B, 4))
    _, grads = bench.numpy_grads(P, x, y)
    eps = 1e-6
    for name, p in P.items():
        numeric = np.zeros_like(p)
        for i in np.ndindex(p.shape):
            old = p[i]
            p[i] = old + eps
            up = bench.numpy_grads(P, x, y)[0]
            p[i] = old - eps
            down = bench.numpy_grads(P, x, y)[0]
            p[i] = old
            numeric[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-9, err_msg=name)


def test_the_floor_equals_the_per_step_reference_for_changing_lengths(bench):
    # The floor reuses its buffers across calls: longer, shorter and equal lengths in turn.
    rng = np.random.default_rng(1)
    I, H, B = 3, 5, 2
    P = _float64_params(rng, I, H)
    for T in (6, 2, 9, 9, 1):
        x, y = rng.standard_normal((T, B, I)), rng.standard_normal((B, 4))
        loss, grads = bench.numpy_grads(P, x, y)
        ref_loss, ref = bench.numpy_grads_perstep(P, x, y)
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        for name in PARAMS:
            np.testing.assert_allclose(
                grads[name], ref[name], rtol=1e-10, atol=1e-12, err_msg=f"T={T} {name}"
            )


def test_the_length_schedule_changes_the_structure_every_step(bench):
    lengths = bench.length_schedule(50, 30)
    assert set(lengths) == set(range(45, 56))  # every length of T ± 10%
    assert all(a != b for a, b in itertools.pairwise(lengths))
    assert len(set(lengths[:11])) == 11  # a length returns only after all the others


def test_a_wrong_reference_gradient_is_caught(bench, monkeypatch):
    right = bench.numpy_grads

    def off_by_one_percent(P, x, y):
        loss, grads = right(P, x, y)
        return loss, {**grads, "Wh": grads["Wh"] * 1.01}

    monkeypatch.setattr(bench, "numpy_grads", off_by_one_percent)
    with pytest.raises(bench.BenchmarkMismatch, match="Wh"):
        bench.check_correctness(SMALLEST)


def test_quick_json_run(tmp_path):
    size = ",".join(map(str, SMALLEST))
    # (failing targets do not fail without --strict)
    stdout, data = _run_tool(BENCH, "--quick", "--sizes", size, out=tmp_path / "bench.json", timeout=900)
    assert "PASS" in stdout or "FAIL" in stdout  # the table was printed

    assert {"benchmark", "date", "machine", "config", "correctness", "training", "extras", "all_pass"} <= set(
        data
    )
    machine = data["machine"]
    for key in ("platform", "python", "numpy", "cpu_count"):
        assert machine[key], key
    assert data["config"]["quick"] is True and data["config"]["sizes"] == [list(SMALLEST)]

    rows = data["training"]
    assert sorted(r["mode"] for r in rows) == [
        "per-node-nocache", "rebuild", "rebuild-new", "rebuild-nocache", "reuse"
    ]  # fmt: skip
    impls = ["vgraph", "numpy", "numpy_perstep"] + (["torch_loop", "torch_rnn"] if HAVE_TORCH else [])
    for r in rows:
        assert r["size"] == list(SMALLEST)
        for impl in impls:
            assert r[impl]["median_ms"] > 0 and len(r[impl]["times_ms"]) == r["repeats"]
        assert r["ratio"] == pytest.approx(r["vgraph"]["median_ms"] / r["numpy"]["median_ms"])
        assert r["ratio_vs_perstep"] == pytest.approx(
            r["vgraph"]["median_ms"] / r["numpy_perstep"]["median_ms"]
        )
        for kind in ("loop", "rnn"):
            assert (f"ratio_vs_torch_{kind}" in r) == HAVE_TORCH
            if HAVE_TORCH:
                assert r[f"ratio_vs_torch_{kind}"] == pytest.approx(
                    r["vgraph"]["median_ms"] / r[f"torch_{kind}"]["median_ms"]
                )
        target = {"reuse": 2.0, "rebuild": 2.5, "rebuild-new": 4.0}.get(r["mode"])  # (nocache: none)
        assert r["target"] == target and (r["pass"] is None) == (target is None)
        assert r["nodes"] > 0
    for mode in ("rebuild-new", "rebuild-nocache", "per-node-nocache"):
        new = next(r for r in rows if r["mode"] == mode)
        assert len(new["lengths"]) == new["warmup"] + new["repeats"]
        assert all(45 <= n <= 55 for n in new["lengths"]) and len(set(new["lengths"])) > 1
    if HAVE_TORCH:  # the PyTorch steps were checked against the floor before timing
        errs = data["correctness"][f"({size})"]["torch_max_rel_err"]
        assert set(errs) == {"loop", "rnn"} and all(e <= 1e-10 for e in errs.values())

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
    lin = extras["linearity"]["rows"]
    assert len(lin) == 2
    for r in lin:
        assert all(v > 0 for v in r["backward_ms"] + r["peak_bytes"] + r["kept_value_bytes"])
        assert r["memory_ratio"] == pytest.approx(r["peak_bytes"][1] / r["peak_bytes"][0])
    mem = extras["memory"]
    assert mem["peak_bytes"] > 0 and mem["kept_value_bytes"] > 0
    assert mem["ratio"] == pytest.approx(mem["peak_bytes"] / mem["kept_value_bytes"])


# ---------------------------------------------------------------------------- tools/bench_dynamic.py

DYNAMIC = ROOT / "tools" / "bench_dynamic.py"


@pytest.fixture(scope="module")
def dynamic():
    yield from _tool(DYNAMIC)


def test_generated_sentences_look_like_ptb(dynamic):
    sentences = dynamic.make_sentences(4000, 10_000, seed=1)
    lengths = np.array([len(s) for s in sentences])
    assert lengths.min() >= 1 and lengths.max() <= 80
    assert 20 <= lengths.mean() <= 24 and 8 <= lengths.std() <= 12
    tokens = np.concatenate(sentences)
    assert tokens.min() >= 1 and tokens.max() < 10_000  # id 0 is the sentence boundary
    counts = np.bincount(tokens, minlength=10_000)
    assert counts[1] > counts[2] > counts[10] > counts[1000]  # Zipf: frequent ranks first


def test_lm_batches_are_sorted_padded_and_masked(dynamic):
    sentences = dynamic.make_sentences(50, 100, seed=2)
    batches = dynamic.lm_batches(sentences, 16, seed=0)
    assert sorted(b.tokens.shape[1] for b in batches) == [2, 16, 16, 16]
    assert sum(b.words for b in batches) == sum(len(s) + 1 for s in sentences)
    for b in batches:
        T, B = b.tokens.shape
        assert b.targets.shape == b.weights.shape == (T * B,)
        assert b.weights.sum() == pytest.approx(1.0, rel=1e-5)  # the mean over real words
        assert np.count_nonzero(b.weights) == b.words
        # each column is the start symbol, the words, then padding; targets are shifted by one
        targets = b.targets.reshape(T, B)
        np.testing.assert_array_equal(b.tokens[0], 0)
        np.testing.assert_array_equal(targets[:-1], b.tokens[1:])


def test_the_lm_floor_equals_vgraph(dynamic):
    report = dynamic.check_lstm_lm()
    assert set(report["max_rel_err"]) >= {"loss", *dynamic.LM_PARAMS}
    assert all(e <= 1e-9 for e in report["max_rel_err"].values()), report


def test_a_wrong_lm_floor_is_caught(dynamic, monkeypatch):
    right = dynamic.NumpyLM.grads

    def wrong(self, batch):
        loss, grads, phases = right(self, batch)
        return loss, {**grads, "lstm.W_h": grads["lstm.W_h"] * 1.001}, phases

    monkeypatch.setattr(dynamic.NumpyLM, "grads", wrong)
    with pytest.raises(dynamic.BenchmarkMismatch, match=r"lstm\.W_h"):
        dynamic.check_lstm_lm()


def test_dynamic_quick_json_run(tmp_path):
    _, data = _run_tool(DYNAMIC, "--quick", out=tmp_path / "dynamic.json")
    assert data["config"]["quick"] is True
    assert set(data["correctness"]) == {"lstm_lm", "bilstm_tagger", "tree_lstm", "adaptive_loop"}
    for task in ("lstm_lm", "bilstm_tagger", "tree_lstm"):  # PyTorch = vgraph before any timing
        torch_check = data["correctness"][task].get("torch")
        assert (torch_check is not None) == HAVE_TORCH, task
        if HAVE_TORCH:
            assert torch_check and all(e <= 1e-10 for e in torch_check.values()), (task, torch_check)
    assert data["correctness"]["adaptive_loop"]["decisions_equal"] is True
    assert data["correctness"]["bilstm_tagger"]["gradcheck"] == "passed"
    assert data["correctness"]["tree_lstm"]["gradcheck"] == "passed"
    rows = data["rows"]
    assert {r["task"] for r in rows} == {"lstm_lm", "bilstm_tagger", "tree_lstm", "adaptive_loop"}
    assert all(r["sparse_speedup"] > 0 for r in rows if r["task"] in ("bilstm_tagger", "tree_lstm"))
    # every autobatched column is compared with its one-at-a-time (or padded) column
    batched = [(r["task"], name) for r in rows for name in r["columns"] if name.startswith("batch")]
    assert {t for t, _ in batched} == {"lstm_lm", "bilstm_tagger", "tree_lstm", "adaptive_loop"}
    assert all(r["batch_speedup"][n]["cpu"] > 0 for r in rows for n in r["columns"] if n.startswith("batch"))
    lm_numpy = [r for r in rows if "numpy" in r["columns"]]
    assert lm_numpy and all(r["task"] == "lstm_lm" for r in lm_numpy)
    assert all(r["ratio_vs_numpy"] > 0 and r["ratio_vs_numpy_cpu"] > 0 for r in lm_numpy)
    for r in rows:
        torch_columns = {n for n in r["columns"] if n.startswith("torch")}
        expected = {"bilstm_tagger": {"torch", "torch_batch32"}, "tree_lstm": {"torch", "torch_batch32"}}.get(
            r["task"], {"torch"} if "numpy" in r["columns"] else set()
        )
        assert torch_columns == (expected if HAVE_TORCH else set()), r["task"]
        if HAVE_TORCH and expected:
            compared = {
                "bilstm_tagger": {
                    "sparse",
                    "programs",
                    "bidirectional",
                    "batch32",
                    "batch32_programs",
                    "batch32_bidirectional",
                },
                "tree_lstm": {"sparse", "programs", "batch32", "batch32_programs"},
            }
            assert set(r["ratio_vs_torch"]) == compared.get(r["task"], {"vgraph", "programs"}), r["task"]
            for vg_name, vt in r["ratio_vs_torch"].items():
                assert vt["wall"] == pytest.approx(
                    r["columns"][vg_name]["ms_per_batch"] / r["columns"][vt["torch"]]["ms_per_batch"]
                )
        for name, c in r["columns"].items():
            assert c["words_per_s"] > 0 and c["peak_bytes"] > 0, (r["task"], name)
            assert set(c["phase_ms_per_batch"]) == {"build", "forward", "backward", "update"}
            assert c["ms_per_batch"] == pytest.approx(sum(c["phase_ms_per_batch"].values()), rel=0.05)
            assert math.isfinite(c["first_loss"]) and math.isfinite(c["last_loss"])
            assert c["cpu_ms_per_batch"] > 0 and set(c["phase_cpu_ms_per_batch"]) == set(
                c["phase_ms_per_batch"]
            )
        assert r["columns"]["vgraph"]["nodes_per_batch"] > 0
        # the build is split from the forward (by the extra pass) where the forward can be re-run
        split = r["task"] != "adaptive_loop"
        assert (r["columns"]["vgraph"]["phase_ms_per_batch"]["forward"] > 0) == split, r["task"]


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_a_wrong_torch_gradient_is_caught(dynamic, bench, monkeypatch):
    right = dynamic.TorchModel.export

    def wrong(self, grads=False):
        out = right(self, grads)
        return {**out, "inner.U": out["inner.U"] * 1.001} if grads else out

    monkeypatch.setattr(dynamic.TorchModel, "export", wrong)
    with pytest.raises(dynamic.BenchmarkMismatch, match=r"tree_lstm torch.*inner\.U"):
        dynamic.check_torch_tree()
    right_grads = bench.TorchTrainer.grads

    def wrong_rnn(self, x, y):
        loss, grads = right_grads(self, x, y)
        return loss, {**grads, "Wh": grads["Wh"] * 1.001}

    monkeypatch.setattr(bench.TorchTrainer, "grads", wrong_rnn)
    with pytest.raises(bench.BenchmarkMismatch, match="PyTorch loop"):
        bench.check_torch(SMALLEST)


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_torch_sparse_adam_is_checked_against_lazy_adam(dynamic, monkeypatch):
    """The check compares parameters after two updates, the second on other words: dense Adam on
    the PyTorch side (which moves rows not looked up) is caught."""
    real = dynamic.TorchTree.__init__

    def dense_update(self, cfg, sparse):  # sparse gradients made dense, updated by dense Adam
        real(self, cfg, False)

    monkeypatch.setattr(dynamic.TorchTree, "__init__", dense_update)
    with pytest.raises(dynamic.BenchmarkMismatch, match=r"tree_lstm torch \(sparse.*emb\.W after"):
        dynamic.check_torch_tree()


def test_benchmarks_run_without_torch(tmp_path):
    """With torch not importable, both benchmarks say so in one line and run without its columns."""
    hidden = _hidden_torch(tmp_path)
    size = ",".join(map(str, SMALLEST))
    args = ("--quick", "--sizes", size, "--modes", "rebuild", "--no-extras")
    stdout, data = _run_tool(BENCH, *args, out=tmp_path / "rnn.json", hide_torch=hidden)
    assert stdout.count("PyTorch columns skipped: torch is not installed") == 1
    (row,) = data["training"]
    assert not [k for k in row if "torch" in k]
    args = ("--quick", "--tasks", "tree_lstm")
    stdout, data = _run_tool(DYNAMIC, *args, out=tmp_path / "dynamic.json", hide_torch=hidden)
    assert stdout.count("PyTorch columns skipped: torch is not installed") == 1
    assert set(data["rows"][0]["columns"]) == {"vgraph", "sparse", "programs", "batch32", "batch32_programs"}
    assert "torch" not in data["correctness"]["tree_lstm"]


def test_the_paired_ab_tool_runs_both_versions_in_their_own_processes(tmp_path):
    """tools/bench_ab.py with two directories (here both this checkout): each side runs from its
    own fresh copy of the working tree (removed afterwards), one row per size and mode comes out
    with a ratio and the JSON report; a spec that is neither a directory nor a revision is refused
    before anything runs."""
    report = tmp_path / "ab.json"
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_ab.py"), str(ROOT), str(ROOT), "--sizes", "4,8,2,3",
         "--modes", "rebuild-new", "--rounds", "1", "--steps", "2", "--repeats", "1", "--json", str(report)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    copies = [line.split(" (", 1)[1].rstrip(")") for line in out.stdout.splitlines()[:2]]
    assert [Path(c).name for c in copies] == ["0-copy", "1-copy"], out.stdout
    assert not any(Path(c).exists() for c in copies)
    rows = json.loads(report.read_text())["rows"]
    assert [(r["size"], r["mode"]) for r in rows] == [("4,8,2,3", "rebuild-new")]
    assert rows[0]["ratio_median"] > 0 and len(rows[0]["old_ms"]) == len(rows[0]["new_ms"]) == 1
    bad = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_ab.py"), "no-such-revision-or-directory"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "neither a directory nor a git revision" in bad.stderr


# ---------------------------------------------------------------------------- tools/bench_seq2seq.py

SEQ2SEQ = ROOT / "tools" / "bench_seq2seq.py"
BRANCHES = ROOT / "tools" / "bench_branches.py"


@pytest.fixture(scope="module")
def seq2seq():
    yield from _tool(SEQ2SEQ)


def test_seq2seq_pairs_have_their_own_lengths(seq2seq):
    pairs = seq2seq.make_pairs(2000, 4000, seed=1)
    src = np.array([len(p.tokens) for p in pairs])
    tgt = np.array([p.words for p in pairs])
    assert src.min() == 5 and src.max() == 40 and 16 <= src.mean() <= 20
    assert tgt.min() >= 5 and tgt.max() <= 40 and len(set(zip(src, tgt))) > 300
    for p in pairs[:50]:  # teacher forcing: the decoder reads the start symbol and the words before
        assert p.tokens.shape == (len(p.tokens), 1) and p.tgt_in.shape == (p.words, 1)
        assert p.tgt_in[0, 0] == 0 and p.tgt_out[-1] == 0 and (p.tokens > 0).all()
        np.testing.assert_array_equal(p.tgt_in[1:, 0], p.tgt_out[:-1])


def test_seq2seq_quick_json_run(tmp_path):
    _, data = _run_tool(SEQ2SEQ, "--quick", out=tmp_path / "seq2seq.json")
    assert data["config"]["quick"] is True and data["config"]["group"] == 32
    assert len(data["machine"]["source"]["commit"]) == 40  # the commit measured (a git checkout)
    check = data["correctness"]["seq2seq"]
    assert check["gradcheck"] == "passed" and check["max_rel_err_batch"] <= 1e-12
    assert check["max_rel_err_batch_programs"] <= 1e-12
    assert check["max_rel_err_masked"] <= 1e-12
    assert len({tuple(n) for n in check["lengths"]}) > 1  # build_batch was checked on different lengths
    assert ("torch" in check) == HAVE_TORCH
    if HAVE_TORCH:  # PyTorch = vgraph before any timing, one pair and a padded group
        assert set(check["torch"]) == {"sparse_1", "sparse_3", "dense_1", "dense_3"}
        assert all(e <= 1e-10 for e in check["torch"].values()), check["torch"]
    rows = data["rows"]
    assert [r["config"] for r in rows] == ["sparse", "dense"]
    for r in rows:
        batched = {"batch32", "batch32_programs", "batch32_masked"}
        torch_columns = {"torch", "torch_batch32"} if HAVE_TORCH else set()
        assert set(r["columns"]) == {"vgraph", "programs"} | batched | torch_columns
        assert set(r["batch_speedup"]) == batched
        assert all(sp["over"] == "vgraph" and sp["wall"] > 0 for sp in r["batch_speedup"].values())
        assert r["batch_target_met"] == (r["batch_speedup"]["batch32_programs"]["wall"] >= 3.0)
        if HAVE_TORCH:
            assert set(r["ratio_vs_torch"]) == {"vgraph", "programs"} | batched
            for vg_name, vt in r["ratio_vs_torch"].items():
                assert vt["wall"] == pytest.approx(
                    r["columns"][vg_name]["ms_per_batch"] / r["columns"][vt["torch"]]["ms_per_batch"]
                )
            assert r["torch_batch_speedup"]["wall"] == pytest.approx(
                r["columns"]["torch"]["ms_per_batch"] / r["columns"]["torch_batch32"]["ms_per_batch"]
            )
        for c in r["columns"].values():
            assert c["words_per_s"] > 0 and math.isfinite(c["first_loss"]) and math.isfinite(c["last_loss"])
            assert c["ms_per_batch"] == pytest.approx(sum(c["phase_ms_per_batch"].values()), rel=0.05)
        summary = data["summary"][r["config"]]
        assert summary["words_per_s"] == {n: c["words_per_s"] for n, c in r["columns"].items()}


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_a_wrong_seq2seq_torch_model_is_caught(seq2seq, monkeypatch):
    """The padded PyTorch group must mask the padded source positions: without the mask its
    attention reads padding, and the check before timing refuses it."""
    torch = seq2seq.bd._torch()
    real = torch.Tensor.masked_fill

    def unmasked(self, mask, value):
        return real(self, mask, 0.0) if value == float("-inf") else real(self, mask, value)

    monkeypatch.setattr(torch.Tensor, "masked_fill", unmasked)
    with pytest.raises(seq2seq.bd.BenchmarkMismatch, match=r"seq2seq torch \(sparse, 3 pair"):
        seq2seq.check_torch_seq2seq()


def test_seq2seq_runs_without_torch(tmp_path):
    """With torch not importable, the seq2seq benchmark says so in one line and runs without its
    columns."""
    args = ("--quick", "--embeddings", "sparse")
    stdout, data = _run_tool(
        SEQ2SEQ, *args, out=tmp_path / "seq2seq.json", hide_torch=_hidden_torch(tmp_path)
    )
    assert stdout.count("PyTorch columns skipped: torch is not installed") == 1
    (row,) = data["rows"]
    assert set(row["columns"]) == {"vgraph", "programs", "batch32", "batch32_programs", "batch32_masked"}
    assert "ratio_vs_torch" not in row
    assert "torch" not in data["correctness"]["seq2seq"] and data["machine"]["torch"] is None


def test_branches_run_checks_and_writes_json(tmp_path):
    """tools/bench_branches.py checks the three ways equal, then times them."""
    stdout, data = _run_tool(
        BRANCHES, "--batch", "4", "--hidden", "8", "--repeats", "1", out=tmp_path / "b.json"
    )
    assert stdout.startswith("correctness: rows = op by op = one at a time")
    assert set(data["ms_per_group"]) == {"rows", "op_by_op", "alone"} and data["batch"] == 4


def _float64_arrays(graph):
    """The keys of the nodes of ``graph`` whose value or gradient is a float64 array."""
    found = set()
    for n in graph.nodes():
        for x in (n.value, n.grad):
            if isinstance(x, np.ndarray) and x.dtype == np.float64:
                found.add(str(n.key))
    return found


def test_float32_models_keep_float32_everywhere(dynamic, seq2seq):
    """The benchmarks' float32 models, built alone and batched, node by node and as programs:
    no value or gradient becomes float64 (a float64 gradient doubles the backward's time, as a
    batched mean over lengths once did)."""
    import vgraph as vg

    tree = dynamic.TreeConfig(vocab=40, embed=6, hidden=5, dtype=np.float32)
    tagger = dynamic.TaggerConfig(vocab=40, embed=6, hidden=5, mlp=4, dtype=np.float32)
    s2s = seq2seq.Seq2seqConfig(vocab=30, embed=6, hidden=4, dtype=np.float32)
    models = [
        (dynamic.make_tree_lstm(tree), [dynamic.tree_feed(b) for b in dynamic.tree_batches(3, 40, seed=1)]),
        (
            dynamic.make_bilstm_tagger(tagger),
            [dynamic.tagger_feed(b) for b in dynamic.tagger_batches(3, 40, 5, seed=1)],
        ),
        (seq2seq.make_seq2seq(s2s), [seq2seq.seq2seq_feed(p) for p in seq2seq.make_pairs(3, 30, seed=1)]),
    ]
    for (g, loss), feeds in models:
        for programs in (False, True):
            batch = g.build_batch(feeds, loss, programs=programs)
            vg.render.retain_all_grads(batch.graph)
            batch.backward("mean")
            assert not _float64_arrays(batch.graph), (g.name, programs)
            cg = g.build(feeds[0], loss, programs=programs, cache=False)
            vg.render.retain_all_grads(cg)
            cg.backward(cg.outputs[0])
            assert not _float64_arrays(cg), (g.name, programs)
            assert all(
                np.asarray(p.grad).dtype == np.float32 for p in g.params.values() if p.grad is not None
            )
            g.params.zero_grad()


@pytest.mark.parametrize(
    ("schedule", "order"),
    [
        ("interleaved", ["a1", "b1", "b2", "a2", "a1", "b1", "b2", "a2"]),
        ("blocked", ["a1", "a2", "b1", "b2", "b1", "b2", "a1", "a2"]),
    ],
)
def test_a_pass_orders_its_columns_steps_by_schedule(dynamic, schedule, order):
    """Interleaved: the columns alternate batch by batch (order reversed every batch); blocked:
    each column runs a whole round in turn (order reversed every round)."""
    seen = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def step(self, batch):
            seen.append(f"{self.name}{batch}")
            return 0.0, {k: (0.001, 0.001) for k in dynamic.PHASES}

    cols = {"a": lambda cfg, data: Fake("a"), "b": lambda cfg, data: Fake("b")}
    out = dynamic._timed_pass(cols, None, [1, 2], rounds=2, warmup=0, schedule=schedule)
    assert seen == order
    assert all(len(out[n]["wall"]) == 2 for n in cols)
