"""Checkpoints: round trips (untied, dotted names), atomic saves, loads that change nothing on error."""

from __future__ import annotations

import os

import numpy as np
import pytest

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
