"""Checkpoints: round trips (untied, dotted names), atomic saves, loads that change nothing on error."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import vgraph as vg
from vgraph import io, nn


def make_model(seed=0, dtype=np.float64, hidden=3):
    """A model with shared, dotted (module) and untied nested-loop ("W@1.2") parameters."""
    g = vg.VirtualGraph(dtype=dtype, seed=seed)
    x = g.input("x", (None, None, 2))
    fc = nn.Linear(g, 2, hidden, "enc.fc")
    zeros = g.constant(np.zeros(hidden))
    with g.loop() as outer:
        x_t = outer.step(x)
        h = outer.carry(zeros, name="h")
        with g.loop(times=2) as inner:
            u = inner.carry(h, name="u")
            w = g.parameter("W", (hidden,), init="normal")  # untied per (outer, inner) iteration
            inner.update(u, vg.tanh(u * w))
        outer.update(h, inner.final(u) + fc(x_t).sum(0))
    out = outer.final(h).sum()
    return g, out


def built(seed=0, T=2, **kw):
    g, out = make_model(seed, **kw)
    g.build({"x": np.ones((T, 1, 2))}, out)
    return g


def values(g):
    return {k: np.array(v.value) for k, v in g.params.items()}


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert a[k].dtype == b[k].dtype


def test_round_trip_with_untied_and_dotted_names(tmp_path):
    g = built(seed=1)
    assert {"W@0.0", "W@1.1", "enc.fc.W", "enc.fc.b"} <= set(g.params)
    path = tmp_path / "model.ckpt"
    io.save(g, path)
    assert os.listdir(tmp_path) == ["model.ckpt"]  # no suffix added, no temporary left
    with np.load(path) as data:  # a plain .npz
        assert sorted(data.files) == sorted(g.params)
    g2, _ = make_model(seed=99)  # fresh model: untied entries do not exist yet
    io.load(g2, path)
    assert_same(values(g2), values(g))


def test_round_trip_float32_and_store_or_mapping(tmp_path):
    g = built(seed=2, dtype=np.float32)
    io.save(g.params, tmp_path / "a.npz")
    io.save({"file": np.arange(3.0), "W@1.2": np.ones(2)}, tmp_path / "b.npz")  # "file" is np.savez's arg
    g2 = built(seed=3, dtype=np.float32)
    io.load(g2, tmp_path / "a.npz")
    assert_same(values(g2), values(g))
    back = io.read(tmp_path / "b.npz")
    np.testing.assert_array_equal(back["file"], np.arange(3.0))
    np.testing.assert_array_equal(back["W@1.2"], np.ones(2))


def test_overwrite_replaces_and_keeps_permissions(tmp_path):
    path = tmp_path / "ck.npz"
    g = built(seed=1)
    io.save(g, path)
    os.chmod(path, 0o640)
    g.params.set_value("enc.fc.b", np.full(3, 7.0))
    io.save(g, path)
    assert io.read(path)["enc.fc.b"].tolist() == [7.0, 7.0, 7.0]
    assert os.stat(path).st_mode & 0o777 == 0o640
    mask = os.umask(0o022)
    os.umask(mask)
    io.save(g, tmp_path / "new.npz")  # a new checkpoint gets the usual mode, not mkstemp's 0600
    assert os.stat(tmp_path / "new.npz").st_mode & 0o777 == 0o666 & ~mask


# --- atomicity ---------------------------------------------------------------------------------


def _old_checkpoint(tmp_path):
    g = built(seed=1)
    path = tmp_path / "ck.npz"
    io.save(g, path)
    return g, path, path.read_bytes()


def test_failure_while_writing_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    g, path, old_bytes = _old_checkpoint(tmp_path)
    g.params.set_value("enc.fc.b", np.full(3, 5.0))
    real = np.lib.format.write_array
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # mid-save: after one array was written
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", failing)
    with pytest.raises(OSError, match="disk full"):
        io.save(g, path)
    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["ck.npz"]


def test_failure_at_rename_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    g, path, old_bytes = _old_checkpoint(tmp_path)

    def failing_replace(src, dst):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        io.save(g, path)
    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["ck.npz"]


def test_failed_first_save_creates_nothing(tmp_path, monkeypatch):
    g = built()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(np.lib.format, "write_array", interrupted)
    with pytest.raises(KeyboardInterrupt):
        io.save(g, tmp_path / "new.npz")
    assert os.listdir(tmp_path) == []


# --- load errors change nothing ----------------------------------------------------------------


def _expect_unchanged_error(g, path, match, **kw):
    before = values(g)
    with pytest.raises(vg.CheckpointError, match=match):
        io.load(g, path, **kw)
    assert_same(values(g), before)


def test_load_wrong_shape(tmp_path):
    io.save(built(seed=1, hidden=4), tmp_path / "ck.npz")
    _expect_unchanged_error(built(seed=2, hidden=3), tmp_path / "ck.npz", "shape")


def test_load_missing_name_strict_and_non_strict(tmp_path):
    g = built(seed=1, T=1)  # untied entries of outer iteration 0 only
    io.save(g, tmp_path / "ck.npz")
    g2 = built(seed=2, T=2)  # also has W@1.0, W@1.1
    _expect_unchanged_error(g2, tmp_path / "ck.npz", "lacks")
    io.load(g2, tmp_path / "ck.npz", strict=False)
    for k in g.params:
        np.testing.assert_array_equal(g2.params[k].value, g.params[k].value)


def test_load_extra_name(tmp_path):
    state = built(seed=1).params.state_dict()
    state["decoder.W"] = np.zeros(3)
    io.save(state, tmp_path / "ck.npz")
    _expect_unchanged_error(built(seed=2), tmp_path / "ck.npz", "decoder.W")
    _expect_unchanged_error(built(seed=2), tmp_path / "ck.npz", "decoder.W", strict=False)


def test_load_bad_untied_index_and_tied_name_with_index(tmp_path):
    state = built(seed=1).params.state_dict()
    bad = dict(state, **{"W@x": np.zeros(3)})
    io.save(bad, tmp_path / "a.npz")
    _expect_unchanged_error(built(seed=2), tmp_path / "a.npz", "W@x")
    tied = dict(state, **{"enc.fc.b@0": np.zeros(3)})
    io.save(tied, tmp_path / "b.npz")
    _expect_unchanged_error(built(seed=2), tmp_path / "b.npz", "enc.fc.b@0")


def test_load_dtype_mismatch_and_cast(tmp_path):
    io.save(built(seed=1, dtype=np.float64), tmp_path / "ck.npz")
    g = built(seed=2, dtype=np.float32)
    _expect_unchanged_error(g, tmp_path / "ck.npz", "dtype")
    io.load(g, tmp_path / "ck.npz", cast=True)
    src = io.read(tmp_path / "ck.npz")
    for k, v in g.params.items():
        assert v.value.dtype == np.float32
        np.testing.assert_array_equal(v.value, src[k].astype(np.float32))
    ints = {k: np.zeros(v.shape, dtype=np.int64) for k, v in g.params.items()}
    io.save(ints, tmp_path / "int.npz")
    _expect_unchanged_error(g, tmp_path / "int.npz", "float")


def test_load_corrupt_files(tmp_path):
    g = built(seed=1)
    good = tmp_path / "good.npz"
    io.save(g, good)
    data = good.read_bytes()
    cases = {
        "garbage.npz": b"this is not a checkpoint at all",
        "truncated.npz": data[: len(data) // 2],
        "empty.npz": b"",
    }
    # flip bytes inside the first member's array data: the zip checksum no longer matches
    flipped = bytearray(data)
    pos = data.index(b"NUMPY") + 200
    flipped[pos : pos + 8] = bytes(b ^ 0xFF for b in flipped[pos : pos + 8])
    cases["flipped.npz"] = bytes(flipped)
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        _expect_unchanged_error(g, tmp_path / name, "not an .npz|not a readable .npz|corrupt")
    np.save(tmp_path / "single.npy", np.zeros(3))
    _expect_unchanged_error(g, tmp_path / "single.npy", "single .npy")
    _expect_unchanged_error(g, tmp_path / "missing.npz", "no checkpoint")


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError):
        io.save([1, 2, 3], tmp_path / "x.npz")
    with pytest.raises(TypeError):
        io.save({"a": np.array(["text"])}, tmp_path / "x.npz")
    assert os.listdir(tmp_path) == []


# --- symmetric state_dict / load_state_dict ------------------------------------------------------


def test_graph_and_store_both_have_state_dict_and_load_state_dict():
    g = built(seed=1)
    sd = g.state_dict()
    assert_same(sd, g.params.state_dict())
    g2 = built(seed=2)
    g2.params.load_state_dict(sd)
    assert_same(values(g2), sd)
    before = values(g2)
    with pytest.raises(KeyError, match="decoder"):
        g2.params.load_state_dict({**sd, "decoder": np.zeros(3)})
    with pytest.raises(vg.ShapeError, match=r"enc\.fc\.b"):
        g2.params.load_state_dict({**sd, "enc.fc.b": np.zeros(4)})
    with pytest.raises(KeyError, match="lacks"):
        g2.params.load_state_dict({"enc.fc.b": np.zeros(3)})
    with pytest.raises(TypeError):
        g2.params.load_state_dict([1, 2])
    assert_same(values(g2), before)
    g2.params.load_state_dict({"enc.fc.b": np.full(3, 2.0)}, strict=False)
    assert g2.params["enc.fc.b"].value.tolist() == [2.0, 2.0, 2.0]


# --- saving over read-only files, stale temporaries, argument types (issue 9 §2, §3) -------------


def test_save_over_a_read_only_checkpoint_is_refused_like_np_save(tmp_path, monkeypatch):
    g, path, old_bytes = _old_checkpoint(tmp_path)
    os.chmod(path, 0o444)
    g.params.set_value("enc.fc.b", np.full(3, 5.0))
    if os.geteuid() == 0:  # root may write anything: simulate the permission check (np.save's open)
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda p, m: False if os.fspath(p) == str(path) else real_access(p, m)
        )
    else:
        with pytest.raises(PermissionError):
            np.save(str(path), np.zeros(1))  # what we imitate
    with pytest.raises(PermissionError, match="read-only") as info:
        io.save(g, path)
    assert info.value.filename == str(path)
    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["ck.npz"]


def test_save_onto_a_directory_is_an_error(tmp_path):
    (tmp_path / "d.npz").mkdir()
    with pytest.raises(IsADirectoryError):
        io.save(built(), tmp_path / "d.npz")
    assert os.listdir(tmp_path) == ["d.npz"]


KILLED_SAVE = """
import sys, time
import numpy as np
from vgraph import io
real = np.lib.format.write_array
def slow(*args, **kwargs):
    real(*args, **kwargs)
    print("writing", flush=True)
    time.sleep(60)  # killed here, mid-save
np.lib.format.write_array = slow
io.save({"a": np.zeros(3), "b": np.ones(2)}, sys.argv[1])
"""


def test_a_killed_save_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    g, path, old_bytes = _old_checkpoint(tmp_path)
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    script.unlink()
    stale = [n for n in os.listdir(tmp_path) if n != "ck.npz"]
    assert len(stale) == 1 and stale[0].startswith(".ck.npz.") and stale[0].endswith(".tmp"), stale
    assert path.read_bytes() == old_bytes  # the kill did not touch the checkpoint
    # A temporary of another target, and one of a live process (a save in progress), are kept.
    other = tmp_path / f".other.npz.{proc.pid}-0123456789ab.tmp"
    live = tmp_path / f".ck.npz.{os.getppid()}-0123456789ab.tmp"
    other.write_bytes(b"")
    live.write_bytes(b"")
    io.save(g, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ck.npz", other.name, live.name])


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda p: io.load(5, p), "graph must be a VirtualGraph"),
        (lambda p: io.load("model", p), "graph must be a VirtualGraph"),
        (lambda p: io.load(built(), 5), "path must be a str or os.PathLike"),
        (lambda p: io.load(built(), p, strict="yes"), "strict"),
        (lambda p: io.load(built(), p, cast=None), "cast"),
        (lambda p: io.save(built(), None), "path must be"),
        (lambda p: io.read(3.5), "path must be"),
        (lambda p: io.save_training_state(built(), p, optimizer="adam"), "optimizer must be"),
        (lambda p: io.save_training_state(built(), p, rng=np.random.RandomState(0)), "rng must be"),
        (lambda p: io.save_training_state(built(), p, step="3"), "step must be"),
        (lambda p: io.load_training_state(5, p), "graph must be"),
    ],
)
def test_wrong_argument_types_are_type_errors_naming_the_argument(tmp_path, call, match):
    path = tmp_path / "ck.npz"
    io.save(built(), path)
    with pytest.raises(TypeError, match=match):
        call(path)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda p: io.load(built(), p, strict="yes"), vg.ArgumentError, "strict must be True or False, got str 'yes'"),
        (lambda p: io.load(built(), p, cast=1), vg.ArgumentError, "cast must be True or False, got int 1"),
        (lambda p: io.load_training_state(built(), p, strict=None), vg.ArgumentError, "strict must be True or False"),
        (lambda p: io.save_training_state(built(), p, step=True), vg.ArgumentError,
         "step must be an int >= 0 or None, got bool True"),
        (lambda p: io.save_training_state(built(), p, step=2.0), vg.ArgumentError, "got float 2.0"),
        (lambda p: io.save_training_state(built(), p, step=-1), vg.ArgumentValueError,
         r"step must be an int >= 0 or None, got -1"),
    ],
)  # fmt: skip
def test_flags_and_step_are_checked_as_every_vgraph_argument(tmp_path, call, error, match):
    """The flags and ``step`` are checked by the package's shared argument checks: typed errors
    (an ArgumentError is a TypeError, an ArgumentValueError a ValueError) and nothing written."""
    path = tmp_path / "ck.npz"
    io.save(built(), path)
    before = path.read_bytes()
    with pytest.raises(error, match=match):
        call(path)
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_a_numpy_integer_step_is_saved_as_an_int(tmp_path):
    io.save_training_state(built(), tmp_path / "s.npz", step=np.int64(4))
    assert io.load_training_state(built(), tmp_path / "s.npz") == 4


# --- whole training state: resume bit for bit in a fresh process (issue 14) ----------------------

TRAIN = """
import sys
import numpy as np
import vgraph as vg
from vgraph import io, nn, optim

def model():
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (None, None, 3))
    y = g.input("y", (None, 1))
    cell = nn.RNNCell(g, 3, 8, "rnn")
    drop = nn.Dropout(g, p=0.3)                 # masks seeded by the graph's build counter
    with g.loop() as L:
        h = L.carry(np.zeros((4, 8)), name="h")
        x_t = L.step(x)
        scale = g.parameter("scale", init=np.ones(8))  # untied: one copy per time step
        L.update(h, cell(drop(x_t), h) * scale)
    loss = vg.losses.mse_loss(nn.Linear(g, 8, 1, "head")(L.final(h)), y)
    return g, loss

def train(g, loss, opt, sched, rng, steps):
    for _ in range(steps):
        T = int(rng.integers(1, 7))              # longer sequences later create new untied copies
        feed = {"x": rng.standard_normal((T, 4, 3)), "y": rng.standard_normal((4, 1))}
        cg = g.build(feed, loss)
        opt.zero_grad()
        cg.backward(loss)
        optim.clip_grad_norm_(g.params, 1.0)
        opt.step()
        sched.step()

mode, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
g, loss = model()
opt = optim.Adam(g.params, lr=0.05)
sched = optim.StepLR(opt, step_size=3, gamma=0.5)
rng = np.random.default_rng(1)
if mode == "resume":
    start = io.load_training_state(g, path, opt, sched, rng=rng)
    assert start == steps, start
train(g, loss, opt, sched, rng, steps)
if mode == "first":
    io.save_training_state(g, path, opt, sched, step=steps, rng=rng)
else:
    io.save(g, sys.argv[4])
"""


def test_resume_in_a_fresh_process_is_bit_for_bit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))

    def run(*args):
        subprocess.run([sys.executable, str(script), *map(str, args)], check=True, env=env, cwd=tmp_path)

    run("straight", tmp_path / "unused", 12, tmp_path / "straight.npz")
    run("first", tmp_path / "state.npz", 6)
    run("resume", tmp_path / "state.npz", 6, tmp_path / "resumed.npz")
    straight, resumed = io.read(tmp_path / "straight.npz"), io.read(tmp_path / "resumed.npz")
    assert any(k.startswith("scale@") and int(k[6:]) >= 2 for k in straight)
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert straight[k].tobytes() == resumed[k].tobytes(), k
    # The half-way file holds untied copies created in the first half, with their Adam moments.
    half = io.read(tmp_path / "state.npz")
    assert "param/scale@0" in half and "optim/scale@0/exp_avg" in half


def _train_once(g):
    out = next(n for n in reversed(g.nodes) if n.kind == "op")
    cg = g.build({"x": np.ones((2, 1, 2))}, out)
    g.params.zero_grad()
    cg.backward(out)


def test_training_state_load_checks_everything_first(tmp_path):
    g = built(seed=1)
    opt = vg.optim.Adam(g.params, lr=0.1)
    sched = vg.optim.StepLR(opt, step_size=2)
    _train_once(g)
    opt.step()
    sched.step()
    rng = np.random.default_rng(0)
    path = tmp_path / "state.npz"
    io.save_training_state(g, path, opt, sched, step=1, rng=rng)

    def fresh():
        g2 = built(seed=2)
        o2 = vg.optim.Adam(g2.params, lr=0.5)
        return g2, o2, vg.optim.StepLR(o2, step_size=2), np.random.default_rng(5)

    def unchanged(case, match, **kw):
        g2, o2, s2, r2 = fresh()
        before = (values(g2), o2.state_dict(), s2.state_dict(), r2.bit_generator.state, g2._builds)
        args = dict(optimizer=o2, scheduler=s2, rng=r2)
        args.update(kw)
        with pytest.raises(vg.CheckpointError, match=match):
            io.load_training_state(g2, case, **args)
        after = (values(g2), o2.state_dict(), s2.state_dict(), r2.bit_generator.state, g2._builds)
        assert_same(after[0], before[0])
        assert after[2:] == before[2:]
        assert after[1]["hyperparameters"] == before[1]["hyperparameters"] and after[1]["state"] == {}

    arrays = io.read(path)
    # A wrong optimiser class, a mangled moment, a wrong generator, a missing component.
    bad = dict(arrays)
    bad["optim/enc.fc.b/exp_avg"] = np.zeros(7)
    io.save(bad, tmp_path / "bad_moment.npz")
    unchanged(tmp_path / "bad_moment.npz", "optimiser state does not match.*enc.fc.b")
    unchanged(path, "random generator", rng=np.random.Generator(np.random.MT19937(0)))
    unchanged(path, "holds optimizer state", optimizer=None, scheduler=None)
    bad = dict(arrays)
    bad["param/enc.fc.W"] = np.zeros((5, 5))
    io.save(bad, tmp_path / "bad_param.npz")
    unchanged(tmp_path / "bad_param.npz", "shape")
    io.save(g, tmp_path / "params_only.npz")
    unchanged(tmp_path / "params_only.npz", "not a training state")
    g2, o2, _, _ = fresh()
    sgd = vg.optim.SGD(g2.params, lr=0.1)
    with pytest.raises(vg.CheckpointError, match="Adam optimiser; this one is SGD"):
        io.load_training_state(g2, path, sgd, strict=False)
    with pytest.raises(vg.CheckpointError, match="training state"):
        io.load(g2, path)  # a parameters-only load is pointed to load_training_state
    # And a good load restores everything.
    g2, o2, s2, r2 = fresh()
    assert io.load_training_state(g2, path, o2, s2, rng=r2) == 1
    assert_same(values(g2), values(g))
    assert s2.state_dict() == sched.state_dict() and o2.lr == opt.lr
    assert r2.bit_generator.state == rng.bit_generator.state and g2._builds == g._builds


def test_negative_step_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="step"):
        io.save_training_state(built(), tmp_path / "s.npz", step=-1)
    assert os.listdir(tmp_path) == []


def test_save_into_a_missing_directory_names_the_target(tmp_path):
    target = tmp_path / "no" / "such" / "ck.npz"
    with pytest.raises(FileNotFoundError) as info:
        io.save(built(), target)
    assert info.value.filename == str(target)


# --- malformed training-state files ----------------------------------------------------------


def _state_file(tmp_path, with_extras=True):
    """A valid training state with every component (``extras`` too, if asked)."""
    g = built(seed=1)
    opt = vg.optim.Adam(g.params, lr=0.1)
    sched = vg.optim.StepLR(opt, step_size=2)
    _train_once(g)
    opt.step()
    sched.step()
    rng = np.random.default_rng(0)
    extras = {
        "chunk": 3,
        "carry": {"h0": np.arange(6.0).reshape(2, 3)},
        "losses": [0.5, 0.25],
        "tag": "run-1",
    }
    path = tmp_path / "state.npz"
    io.save_training_state(
        g, path, opt, sched, step=1, rng=rng, **({"extras": extras} if with_extras else {})
    )
    return path, io.read(path)


def _optimizer_snapshot(opt):
    sd = opt.state_dict()
    state = {
        n: {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in e.items()}
        for n, e in sd["state"].items()
    }
    return sd["hyperparameters"], state


def _load_changes_nothing_or_succeeds(path, strict=True, with_extras=True):
    """Load ``path`` into fresh components: it either loads or raises CheckpointError having changed
    nothing. Returns the error (or None)."""
    g2 = built(seed=2)
    o2 = vg.optim.Adam(g2.params, lr=0.5)
    _train_once(g2)
    o2.step()  # some optimiser state to lose
    s2 = vg.optim.StepLR(o2, step_size=2)
    r2 = np.random.default_rng(5)
    extras = {"mine": 1}
    before = (values(g2), _optimizer_snapshot(o2), s2.state_dict(), r2.bit_generator.state, g2._builds)
    try:
        more = {"extras": extras} if with_extras else {}
        io.load_training_state(g2, path, o2, s2, rng=r2, strict=strict, **more)
    except vg.CheckpointError as e:
        after = (values(g2), _optimizer_snapshot(o2), s2.state_dict(), r2.bit_generator.state, g2._builds)
        assert_same(after[0], before[0])
        assert after[1:] == before[1:] and extras == {"mine": 1}
        return e
    return None


def _with_meta(arrays, meta_text):
    out = dict(arrays)
    out[io._META] = np.frombuffer(meta_text.encode("utf-8"), dtype=np.uint8)
    return out


def _meta(arrays):
    return json.loads(arrays[io._META].tobytes().decode("utf-8"))


def _deep(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda m: _deep(100_000), "nested too deeply"),
        (lambda m: json.dumps(m)[:-1] + ', "x": ' + _deep(100_000) + "}", "nested too deeply"),
        (lambda m: {**m, "optimizer": {**m["optimizer"], "steps": [1, 2]}}, r"optimizer\.steps: expected an object"),
        (lambda m: {**m, "optimizer": {**m["optimizer"], "hyperparameters": "fast"}}, r"optimizer\.hyperparameters"),
        (lambda m: {**m, "optimizer": "Adam"}, "optimizer: expected an object"),
        (lambda m: {**m, "optimizer": {**m["optimizer"], "steps": {**m["optimizer"]["steps"], "enc.fc.W": "3"}}},
         "step of parameter 'enc.fc.W'"),
        (lambda m: {**m, "step": "1"}, "step must be an int"),
        (lambda m: {**m, "step": -5}, r"step must be an int >= 0 or None, got -5"),
        (lambda m: {**m, "graph_builds": [3]}, "graph_builds must be an int"),
        (lambda m: {**m, "scheduler": [1]}, "scheduler: expected an object"),
        (lambda m: {**m, "scheduler": {**m["scheduler"], "last_epoch": "2"}}, "schedule state does not match"),
        (lambda m: {**m, "rng": [1]}, "rng: expected an object"),
        (lambda m: {**m, "rng": {**m["rng"], "state": {"state": 1.5, "inc": 3}}}, r'rng\["state"\]\["state"\]'),
        (lambda m: {**m, "rng": {**m["rng"], "state": {"state": 2**200, "inc": 3}}}, "random generator"),
        (lambda m: {**m, "extras": {"dict": {"carry": {"array": 7}}}}, r'extras\["carry"\]: refers to .*extras/7'),
        (lambda m: {**m, "extras": {"dict": {"losses": {"0": 1}}}}, r'extras\["losses"\]: expected'),
        (lambda m: {**m, "extras": [1]}, "extras: expected"),
        (lambda m: {k: v for k, v in m.items() if k != "graph_builds"}, r"lacks \['graph_builds'\]"),
        (lambda m: {**m, "version": True}, "unknown format or version"),
        (lambda m: [m], "not an object"),
        (lambda m: json.dumps(m).replace('"step": 1', '"step": NaN'), "NaN is not a JSON number"),
    ],
)  # fmt: skip
def test_malformed_json_member_is_a_checkpoint_error_naming_the_member(tmp_path, mutate, match):
    with_extras = "extras" in match  # the other cases need no extras (and fail the same without them)
    path, arrays = _state_file(tmp_path, with_extras)
    meta = mutate(_meta(arrays))
    io.save(_with_meta(arrays, meta if isinstance(meta, str) else json.dumps(meta)), tmp_path / "bad.npz")
    error = _load_changes_nothing_or_succeeds(tmp_path / "bad.npz", with_extras=with_extras)
    assert error is not None and re.search(match, str(error)), error


def _paths(tree, prefix=()):
    """Every position in a JSON tree, as a tuple of keys and indices (the root is ())."""
    out, stack = [], [(prefix, tree)]
    while stack:
        at, node = stack.pop()
        out.append(at)
        if isinstance(node, dict):
            stack.extend(((*at, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend(((*at, i), v) for i, v in enumerate(node))
    return sorted(out, key=lambda p: [str(x) for x in p])


_SENTINEL = "@@deep@@"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4) | st.sampled_from(["Adam", "PCG64", "StepLR", "dict", "array", -5, 0, 1]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["dict", "array", "state", "step", "exp_avg", "lr", "x"]), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@given(data=st.data())
def test_fuzzed_training_state_gives_only_checkpoint_errors_and_changes_nothing(data):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        with_extras = data.draw(st.booleans(), label="with extras")
        path, arrays = _state_file(tmp_path, with_extras)
        meta = _meta(arrays)
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            at = data.draw(st.sampled_from(_paths(meta)), label="at")
            op = data.draw(st.sampled_from(["replace", "delete", "deep"]), label="op")
            value = _SENTINEL if op == "deep" else data.draw(json_values, label="value")
            if at == ():
                meta = value
                if op == "deep":
                    break
                continue
            parent = meta
            for key in at[:-1]:
                parent = parent[key]
            if op == "delete":
                del parent[at[-1]]
            else:
                parent[at[-1]] = value
        depth = data.draw(st.sampled_from([900, 5000, 100_000]), label="depth")
        text = json.dumps(meta).replace(json.dumps(_SENTINEL), _deep(depth))
        bad = _with_meta(arrays, text)
        member_op = data.draw(st.sampled_from(["none", "drop", "retype"]), label="member op")
        if member_op != "none":
            key = data.draw(st.sampled_from(sorted(k for k in arrays if k != io._META)), label="member")
            if member_op == "drop":
                del bad[key]
            else:
                bad[key] = data.draw(
                    st.sampled_from([np.zeros(2), np.zeros((3, 2), np.float32), np.arange(3)])
                )
        io.save(bad, tmp_path / "bad.npz")
        strict = data.draw(st.booleans(), label="strict")
        _load_changes_nothing_or_succeeds(tmp_path / "bad.npz", strict, with_extras)


# --- names are user data ---------------------------------------------------------------------


def _model_with_parameter_named(name):
    g = vg.VirtualGraph(dtype=np.float64, seed=0)
    x = g.input("x", (2,))
    w = g.parameter(name, (2,), init="normal")
    b = g.parameter("b", (2,), init="normal")
    loss = ((x * w + b) ** 2).sum()
    return g, loss


@pytest.mark.parametrize("name", [io._META, "param/W", "optim/W/exp_avg", "extras/0"])
def test_a_parameter_named_like_a_member_of_the_format_round_trips(tmp_path, name):
    g, loss = _model_with_parameter_named(name)
    g.params.set_value(name, np.array([1.5, -2.0]))
    io.save(g, tmp_path / "p.npz")
    g2, _ = _model_with_parameter_named(name)
    io.load(g2, tmp_path / "p.npz")  # refused as "a training state" when the name was _META
    assert_same(values(g2), values(g))
    with pytest.raises(vg.CheckpointError, match="not a training state"):
        io.load_training_state(g2, tmp_path / "p.npz")
    # And in a training state, next to the optimiser's arrays and the extras.
    opt = vg.optim.Adam(g.params, lr=0.1)
    cg = g.build({"x": np.ones(2)}, loss)
    cg.backward(loss)
    opt.step()
    io.save_training_state(g, tmp_path / "s.npz", opt)
    g3, _ = _model_with_parameter_named(name)
    o3 = vg.optim.Adam(g3.params, lr=0.1)
    io.load_training_state(g3, tmp_path / "s.npz", o3)
    assert_same(values(g3), values(g))
    assert _optimizer_snapshot(o3) == _optimizer_snapshot(opt)


def test_a_version_1_file_still_loads(tmp_path):
    """The format before extras (version 1), written out by hand."""
    g = built(seed=1)
    names = sorted(g.params)
    rng_state = np.random.default_rng(9).bit_generator.state
    meta = {
        "format": "vgraph-training-state",
        "version": 1,
        "step": 4,
        "graph_builds": 7,
        "optimizer": {"optimizer": "SGD", "steps": {"enc.fc.b": 2},
                      "hyperparameters": {"lr": 0.5, "momentum": 0.9, "dampening": 0.0, "nesterov": False,
                                          "weight_decay": 0.0}},
        "scheduler": None,
        "rng": {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
                "state": {"state": rng_state["state"]["state"], "inc": rng_state["state"]["inc"]}},
    }  # fmt: skip
    arrays = {f"param/{n}": np.full(g.params[n].shape, 0.25) for n in names}
    arrays["optim/enc.fc.b/momentum_buffer"] = np.full(3, 0.125)
    arrays[io._META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    io.save(arrays, tmp_path / "v1.npz")
    g2 = built(seed=2)
    opt = vg.optim.SGD(g2.params, lr=0.1, momentum=0.5)
    rng = np.random.default_rng(0)
    assert io.load_training_state(g2, tmp_path / "v1.npz", opt, rng=rng) == 4
    assert all(np.all(g2.params[n].value == 0.25) for n in names) and g2._builds == 7
    sd = opt.state_dict()
    assert sd["hyperparameters"]["lr"] == 0.5 and sd["hyperparameters"]["momentum"] == 0.9
    assert sd["state"]["enc.fc.b"]["step"] == 2 and np.all(
        sd["state"]["enc.fc.b"]["momentum_buffer"] == 0.125
    )
    assert rng.bit_generator.state == rng_state
    with pytest.raises(vg.CheckpointError, match="holds no extras"):
        io.load_training_state(built(seed=2), tmp_path / "v1.npz", strict=False, extras={})


# --- one check of step for saving and loading ------------------------------------------------


def test_a_negative_step_is_refused_by_load_as_by_save(tmp_path):
    path, arrays = _state_file(tmp_path, with_extras=False)
    with pytest.raises(ValueError, match=r"step must be an int >= 0 or None, got -5"):
        io.save_training_state(built(), tmp_path / "s2.npz", step=-5)
    io.save(_with_meta(arrays, json.dumps({**_meta(arrays), "step": -5})), tmp_path / "bad.npz")
    error = _load_changes_nothing_or_succeeds(tmp_path / "bad.npz", with_extras=False)
    assert error is not None and "step must be an int >= 0 or None, got -5" in str(error)


# --- a full disk -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "save", [lambda g, p: io.save(g, p), lambda g, p: io.save_training_state(g, p, step=1)]
)
def test_a_full_disk_names_the_file_and_loses_nothing(tmp_path, monkeypatch, save):
    g, path, old_bytes = _old_checkpoint(tmp_path)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np.lib.format, "write_array", no_space)
    with pytest.raises(OSError) as info:
        save(g, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert str(path) in str(info.value) and "No space left on device" in str(info.value)
    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["ck.npz"]


# --- extras ----------------------------------------------------------------------------------


def test_extras_round_trip_exactly(tmp_path):
    g = built(seed=1)
    extras = {
        "chunk": 12,
        "losses": [0.1 + 0.2, 1e-300, -0.0, 3.0],
        "carry": {"h0": np.random.default_rng(0).standard_normal((2, 3)), "c0": np.ones((2, 3), np.float32)},
        "tokens": np.arange(5, dtype=np.int16),
        "flags": [True, None, "text", {"nested": [[1, 2], {"array": 1, "dict": 2}]}],
        "pair": (1, 2),
        "np_scalars": [np.float64(0.5), np.int64(3), np.bool_(True)],
        "empty": {},
    }
    io.save_training_state(g, tmp_path / "s.npz", extras=extras)
    back = {"old": 1}
    io.load_training_state(built(seed=2), tmp_path / "s.npz", extras=back)
    assert set(back) == set(extras)
    assert back["chunk"] == 12 and back["losses"] == extras["losses"] and back["pair"] == [1, 2]
    assert back["flags"] == extras["flags"] and back["empty"] == {}
    assert back["np_scalars"] == [0.5, 3, True]
    for k in ("h0", "c0"):
        a, b = back["carry"][k], extras["carry"][k]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert back["tokens"].dtype == np.int16 and back["tokens"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(vg.CheckpointError, match="holds extras state; pass extras="):
        io.load_training_state(built(seed=2), tmp_path / "s.npz")


def test_extras_that_cannot_be_saved_are_refused_naming_their_path(tmp_path):
    cyclic: list = []
    cyclic.append(cyclic)
    for extras, error, match in [
        ({"losses": [1.0, float("nan")]}, ValueError, r'extras\["losses"\]\[1\]: nan is not finite'),
        ({"a": {"b": {1, 2}}}, TypeError, r'extras\["a"\]\["b"\]: cannot save a set'),
        ({"a": {3: 1}}, TypeError, r'extras\["a"\]: keys must be str'),
        ({"o": np.array([None])}, TypeError, r'extras\["o"\]: .*dtype object'),
        ({"c": cyclic}, ValueError, "nested deeper than 32 levels"),
        ([1, 2], TypeError, "extras must be a mapping"),
    ]:
        with pytest.raises(error, match=match):
            io.save_training_state(built(), tmp_path / "s.npz", extras=extras)
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="extras must be a dict"):
        io.load_training_state(built(), tmp_path / "s.npz", extras=[])
