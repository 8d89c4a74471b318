"""Truncated BPTT: progress reporting (vgraph.tbptt.Progress, truncated_bptt(progress=...)) and
resuming in the middle of a sequence (start=, after_chunk=, a checkpoint with extras)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vgraph as vg
from vgraph import io as vio
from vgraph import nn, optim
from vgraph.tbptt import Progress, chunk_feeds, truncated_bptt


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_mode_prints_periodically_with_rate_and_eta():
    out = io.StringIO()
    with Progress(10, desc="train", mode="lines", every=3, file=out) as p:
        for i in range(10):
            p.update(loss=1.0 / (i + 1))
    lines = out.getvalue().splitlines()
    assert [re.search(r" (\d+)/10 ", ln).group(1) for ln in lines] == ["3", "6", "9", "10"]
    assert all(ln.startswith("train") and "step/s" in ln and "elapsed" in ln and "ETA" in ln for ln in lines)
    assert "loss 0.1 " in lines[-1]  # the latest metrics, 4 significant digits


def test_log_keeps_a_line_at_once_and_zero_steps_only_record():
    out = io.StringIO()
    p = Progress(100, mode="lines", file=out)
    p.update(5)
    assert out.getvalue() == ""  # every defaults to total // 10
    p.update(0, log=True, **{"held-out MSE": 0.25})
    assert (
        out.getvalue().count("\n") == 1
        and "5/100" in out.getvalue()
        and "held-out MSE 0.25" in out.getvalue()
    )


def test_auto_is_lines_when_not_a_terminal_and_a_bar_on_one():
    assert Progress(5, mode="auto", file=io.StringIO()).mode == "lines"  # logs, CI
    pytest.importorskip("tqdm")
    tty = FakeTTY()
    with Progress(5, desc="train", mode="auto", file=tty) as p:
        assert p.mode == "bar"
        for _ in range(5):
            p.update(loss=0.5)
    text = tty.getvalue()
    assert "5/5" in text and "step/s" in text and "loss 0.5" in text
    assert re.search(r"<\d\d:\d\d", text)  # tqdm's ETA


def test_without_tqdm_a_bar_falls_back_to_lines(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm` raise ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    out = FakeTTY()
    p = Progress(2, mode="bar", file=out, every=1)
    assert p.mode == "lines"
    p.update(loss=1.0)
    assert "1/2" in out.getvalue() and "ETA" in out.getvalue()


def test_off_prints_nothing():
    out = io.StringIO()
    p = Progress(3, mode="off", file=out)
    p.update(3, log=True, loss=1.0)
    p.write("hello")
    assert out.getvalue() == "" and p.count == 3


@pytest.mark.parametrize(
    "kwargs,error",
    [({"mode": "fancy"}, ValueError), ({"total": "10"}, TypeError), ({"total": -1}, ValueError),
     ({"every": 0}, ValueError), ({"every": 2.5}, TypeError)],
)  # fmt: skip
def test_bad_arguments(kwargs, error):
    args = {"total": 10, **kwargs}
    with pytest.raises(error):
        Progress(**args)


def test_integer_arguments_are_typed_errors():
    """``total``, ``every``, ``k`` and ``start``: a bool or a float is an ArgumentError (a
    TypeError), a value below the minimum an ArgumentValueError (a ValueError); numpy integers
    are taken as Python ints."""
    for kwargs, error, match in [
        ({"total": True}, vg.ArgumentError, "total must be an int >= 0 or None, got bool True"),
        ({"every": 2.5}, vg.ArgumentError, "every must be an int >= 1 or None, got float 2.5"),
        ({"total": -1}, vg.ArgumentValueError, "total must be an int >= 0 or None, got -1"),
        ({"every": 0}, vg.ArgumentValueError, "every must be an int >= 1 or None, got 0"),
    ]:
        with pytest.raises(error, match=match):
            Progress(**{"total": 10, "mode": "off", **kwargs})
    p = Progress(np.int64(10), mode="off", every=np.int32(3))
    assert (p.total, p.every) == (10, 3) and type(p.total) is int and type(p.every) is int
    with pytest.raises(vg.ArgumentError, match="chunk length k must be an int >= 1, got bool True"):
        list(vg.tbptt.chunks(np.zeros(4), True))
    with pytest.raises(vg.ArgumentValueError, match="chunk length k must be an int >= 1, got 0"):
        chunk_feeds({"x": np.zeros(4)}, np.int64(0), sequences=["x"])
    assert [len(c) for c in vg.tbptt.chunks(np.zeros(5), np.int64(2))] == [2, 2, 1]
    g, loss, h_final = rnn()
    args = {
        "graph": g,
        "feeds": [],
        "loss": loss,
        "state": {"h0": h_final},
        "initial": {"h0": np.zeros((2, 4))},
    }
    with pytest.raises(vg.ArgumentError, match="start must be an int >= 0, got bool True"):
        truncated_bptt(start=True, **args)
    with pytest.raises(vg.ArgumentValueError, match="start must be an int >= 0, got -1"):
        truncated_bptt(start=np.int64(-1), **args)
    assert truncated_bptt(start=np.int64(0), **args).start == 0


def rnn():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, 2, 3))
    y = g.input("y", (None, 2, 1))
    h0 = g.input("h0", (2, 4))
    cell = nn.RNNCell(g, 3, 4, "rnn")
    head = nn.Linear(g, 4, 1, "head")
    with g.loop() as L:
        h = L.carry(h0, name="h")
        h_new = cell(L.step(x), h)
        L.update(h, h_new)
    loss = vg.losses.mse_loss(head(L.stack(h_new)), y)
    return g, loss, L.final(h)


def test_truncated_bptt_reports_each_chunk_with_its_loss(capsys):
    g, loss, h_final = rnn()
    rng = np.random.default_rng(0)
    feeds = chunk_feeds({"x": rng.standard_normal((20, 2, 3)), "y": rng.standard_normal((20, 2, 1))},
                        6, sequences=["x", "y"])  # fmt: skip
    assert len(feeds) == 4  # 6 + 6 + 6 + 2
    out = io.StringIO()
    progress = Progress(len(feeds), desc="TBPTT", mode="lines", every=1, file=out, unit="chunk")
    result = truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": np.zeros((2, 4))},
                            optimizer=optim.SGD(g.params, lr=0.1), progress=progress)  # fmt: skip
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and all("chunk/s" in ln for ln in lines)
    for ln, value in zip(lines, result.losses):
        assert f"loss {value:.4g}" in ln
    # progress="lines" makes its own, with the total from len(feeds)
    feeds = chunk_feeds({"x": np.zeros((12, 2, 3)), "y": np.zeros((12, 2, 1))}, 6, sequences=["x", "y"])
    truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": np.zeros((2, 4))}, progress="lines")
    assert "TBPTT  2/2" in capsys.readouterr().out
    with pytest.raises(TypeError, match="progress"):
        truncated_bptt(g, [], loss, {"h0": h_final}, {"h0": np.zeros((2, 4))}, progress=3)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: list(vg.tbptt.chunks(np.zeros(5), "5")), TypeError, "k must be an int"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 2.5)), TypeError, "k must be an int"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 0)), ValueError, ">= 1"),
        (lambda: list(vg.tbptt.chunks(5.0, 2)), ValueError, "scalar"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 2, axis=1)), ValueError, "axis 1"),
        (lambda: list(vg.tbptt.chunks(np.zeros(5), 2, axis=True)), vg.ArgumentError, "axis must be an int"),
        (
            lambda: chunk_feeds({"x": np.zeros(4)}, 2, sequences=["x"], axis=1),
            ValueError,
            r"axis 1 is not an axis of sequence input 'x', of shape \(4,\)",
        ),
        (
            lambda: chunk_feeds({"x": np.zeros((4, 2)), "c": 1.0}, 2, sequences=["x", "c"]),
            ValueError,
            "sequence input 'c' must be a sequence",
        ),
        (lambda: chunk_feeds({"x": np.zeros(4)}, 2, sequences=["x"], axis=0.0), vg.ArgumentError, "axis"),
        (lambda: chunk_feeds({"xs": np.zeros(4)}, 2, sequences="xs"), TypeError, r"\['xs'\]"),
        (lambda: chunk_feeds([1, 2], 2, sequences=["x"]), TypeError, "feed must be a mapping"),
        (lambda: chunk_feeds({"x": np.zeros(4)}, 2, sequences=["y"]), ValueError, "not in the feed"),
    ],
)
def test_chunking_misuse_is_a_typed_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_truncated_bptt_misuse_is_refused_before_any_change():
    g, loss, h_final = rnn()
    before = g.state_dict()
    feeds = [{"x": np.zeros((3, 2, 3)), "y": np.zeros((3, 2, 1))}]
    init = {"h0": np.zeros((2, 4))}
    for kwargs, error, match in [
        ({"graph": "g"}, TypeError, "graph must be a VirtualGraph"),
        ({"optimizer": "adam"}, TypeError, "optimizer must have a step"),
        ({"state": [h_final]}, TypeError, "state must be a mapping"),
        ({"callback": 3}, TypeError, "callback must be callable"),
        ({"initial": {"c0": np.zeros((2, 4))}}, ValueError, "differ"),
    ]:
        args = {"graph": g, "feeds": feeds, "loss": loss, "state": {"h0": h_final}, "initial": init, **kwargs}
        with pytest.raises(error, match=match):
            truncated_bptt(**args)
    after = g.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in g.params.values())


# --- resuming in the middle of a sequence ----------------------------------------------------


def test_start_skips_chunks_and_after_chunk_sees_the_updated_model():
    g, loss, h_final = rnn()
    rng = np.random.default_rng(1)
    xs, ys = rng.standard_normal((12, 2, 3)), rng.standard_normal((12, 2, 1))
    feeds = chunk_feeds({"x": xs, "y": ys}, 3, sequences=["x", "y"])
    seen = []

    def before_step(i, cg, value):
        seen.append(("callback", i, np.array(g.params["head.W"].value)))

    def after(i, result):
        seen.append(("after", i, np.array(g.params["head.W"].value), result.next_chunk, dict(result.state)))

    opt = optim.SGD(g.params, lr=0.1)
    result = truncated_bptt(g, feeds, loss, {"h0": h_final}, {"h0": np.zeros((2, 4))}, optimizer=opt,
                            callback=before_step, start=2, after_chunk=after)  # fmt: skip
    # Chunks 0 and 1 are skipped; indices are those of the feeds.
    assert [(s[0], s[1]) for s in seen] == [("callback", 2), ("after", 2), ("callback", 3), ("after", 3)]
    assert result.start == 2 and len(result.losses) == 2 and result.next_chunk == 4
    # The callback runs before the optimiser step, after_chunk after it.
    assert not np.array_equal(seen[0][2], seen[1][2]) and np.array_equal(seen[1][2], seen[2][2])
    assert seen[1][3] == 3 and seen[3][3] == 4
    np.testing.assert_array_equal(seen[3][4]["h0"], result.state["h0"])
    # Resuming at chunk 2 from the state carried into it equals running straight through.
    g1, loss1, h1 = rnn()
    straight = truncated_bptt(g1, chunk_feeds({"x": xs, "y": ys}, 3, sequences=["x", "y"]), loss1,
                              {"h0": h1}, {"h0": np.zeros((2, 4))}, optimizer=optim.SGD(g1.params, lr=0.1))  # fmt: skip
    g2, loss2, h2 = rnn()
    opt2 = optim.SGD(g2.params, lr=0.1)
    first = truncated_bptt(g2, list(chunk_feeds({"x": xs, "y": ys}, 3, sequences=["x", "y"]))[:2], loss2,
                           {"h0": h2}, {"h0": np.zeros((2, 4))}, optimizer=opt2)  # fmt: skip
    rest = truncated_bptt(g2, chunk_feeds({"x": xs, "y": ys}, 3, sequences=["x", "y"]), loss2, {"h0": h2},
                          first.state, optimizer=opt2, start=first.next_chunk)  # fmt: skip
    assert first.losses + rest.losses == straight.losses
    for k in g1.params:
        assert g1.params[k].value.tobytes() == g2.params[k].value.tobytes()


def test_a_bad_start_is_refused_before_anything_runs():
    g, loss, h_final = rnn()
    before = g.state_dict()
    feeds = [{"x": np.zeros((3, 2, 3)), "y": np.zeros((3, 2, 1))}] * 2
    args = {"graph": g, "loss": loss, "state": {"h0": h_final}, "initial": {"h0": np.zeros((2, 4))}}
    opt = optim.SGD(g.params, lr=0.1)
    for start, error, match in [(-1, ValueError, ">= 0"), (3, ValueError, "past the end of feeds \\(2 chunks\\)"),
                                (1.0, TypeError, "start must be an int"), (True, TypeError, "start must be an int")]:  # fmt: skip
        with pytest.raises(error, match=match):
            truncated_bptt(feeds=feeds, optimizer=opt, start=start, **args)
    with pytest.raises(TypeError, match="after_chunk must be callable"):
        truncated_bptt(feeds=feeds, after_chunk=1, **args)
    with pytest.raises(ValueError, match="past the end of feeds \\(2 chunks\\)"):  # an iterator: no len()
        truncated_bptt(feeds=iter(feeds), optimizer=opt, start=3, **args)
    after = g.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    result = truncated_bptt(feeds=feeds, start=2, **args)  # at the end: nothing to run
    assert result.losses == [] and result.next_chunk == 2 and result.state["h0"].shape == (2, 4)


# A GRU language model trained with truncated BPTT and Adam, with dropout (masks seeded by the
# graph's build counter) and gradient clipping. "straight" runs the whole epoch; "first" saves a
# checkpoint every 3 chunks and dies in chunk 6 (the work after the last save is lost); "resume",
# in a fresh process, loads the latest checkpoint and finishes the epoch.
LM = """
import json
import sys
import numpy as np
import vgraph as vg
from vgraph import io, losses, nn, optim
from vgraph.tbptt import chunk_feeds, truncated_bptt

V, E, H, B, T, K = 11, 6, 8, 3, 40, 5
g = vg.VirtualGraph(dtype=np.float64, seed=3)
tokens = g.input("tokens", (None, B))
targets = g.input("targets", (None, B))
h0 = g.input("h0", (B, H))
emb = nn.Embedding(g, V, E, "emb")
drop = nn.Dropout(g, p=0.2)
cell = nn.GRUCell(g, E, H, "gru")
head = nn.Linear(g, H, V, "head")
embedded = drop(emb(tokens))  # (time, batch, E)
with g.loop() as L:
    h = L.carry(h0, name="h")
    h_new = cell(L.step(embedded), h)
    L.update(h, h_new)
loss = losses.cross_entropy(head(L.stack(h_new)), targets)
h_final = L.final(h)

data = np.random.default_rng(0).integers(0, V, size=(T + 1, B))
feeds = chunk_feeds({"tokens": data[:-1], "targets": data[1:]}, K, sequences=["tokens", "targets"])
opt = optim.Adam(g.params, lr=0.02)
clip = lambda i, cg, value: optim.clip_grad_norm_(g.params, 1.0)
mode, path = sys.argv[1], sys.argv[2]
history, start, carry = [], 0, {"h0": np.zeros((B, H))}
if mode == "resume":
    saved = {}
    io.load_training_state(g, path, opt, extras=saved)
    history, start, carry = saved["losses"], saved["chunk"], saved["carry"]
    assert start == 6 and len(history) == 6, (start, history)


def save_every_3(i, result):
    if result.next_chunk % 3 == 0:
        extras = {"chunk": result.next_chunk, "carry": result.state, "losses": history + result.losses}
        io.save_training_state(g, path, opt, extras=extras)
    if mode == "first" and i == 6:
        raise SystemExit(0)  # killed


result = truncated_bptt(g, feeds, loss, {"h0": h_final}, carry, optimizer=opt, callback=clip,
                        start=start, after_chunk=save_every_3)
assert mode != "first"
out = sys.argv[3]
io.save(g, out)
np.save(out + ".h.npy", result.state["h0"])
with open(out + ".losses.json", "w") as f:
    json.dump(history + result.losses, f)
"""


def test_resume_mid_epoch_in_a_fresh_process_is_bit_for_bit(tmp_path):

    script = tmp_path / "lm.py"
    script.write_text(LM)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def run(*args):
        subprocess.run([sys.executable, str(script), *map(str, args)], check=True, env=env, cwd=tmp_path)

    run("straight", tmp_path / "unused.npz", tmp_path / "straight.npz")
    run("first", tmp_path / "ckpt.npz")
    mid = vio.read(tmp_path / "ckpt.npz")
    assert "param/gru.W_h" in mid and "optim/gru.W_h/exp_avg" in mid
    run("resume", tmp_path / "ckpt.npz", tmp_path / "resumed.npz")

    straight, resumed = vio.read(tmp_path / "straight.npz"), vio.read(tmp_path / "resumed.npz")
    assert (
        sorted(straight)
        == sorted(resumed)
        == ["emb.W", "gru.W_h", "gru.W_x", "gru.b_h", "gru.b_x", "head.W", "head.b"]
    )
    for k in straight:
        assert straight[k].tobytes() == resumed[k].tobytes(), k
    for suffix in (".h.npy",):
        a, b = (
            np.load(str(tmp_path / "straight.npz") + suffix),
            np.load(str(tmp_path / "resumed.npz") + suffix),
        )
        assert a.tobytes() == b.tobytes()
    losses = [
        json.loads((tmp_path / f"{name}.npz.losses.json").read_text()) for name in ("straight", "resumed")
    ]
    assert len(losses[0]) == 8 and losses[0] == losses[1]  # 40 steps in chunks of 5; floats exactly equal


def test_progress_add_option_offers_the_modes_progress_takes(capsys):
    """The examples' ``--progress`` option: every choice makes a Progress, ``auto`` by default, an
    unknown one is refused by the parser."""
    import argparse

    from vgraph.tbptt import Progress

    parser = argparse.ArgumentParser()
    Progress.add_option(parser, help="where it goes")
    assert parser.parse_args([]).progress == "auto"
    choices = next(a.choices for a in parser._actions if a.dest == "progress")
    for mode in choices:
        with Progress(2, mode=parser.parse_args(["--progress", mode]).progress, file=io.StringIO()) as p:
            p.update(loss=1.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["--progress", "tqdm"])
    assert "invalid choice: 'tqdm'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="progress mode must be one of"):
        Progress(2, mode="tqdm")
    assert "where it goes" in parser.format_help()
