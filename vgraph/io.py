"""Checkpoints: parameter values saved to and loaded from ``.npz`` files, safely.

A checkpoint is a standard numpy ``.npz`` archive (``np.load`` reads it) with one array per
parameter, keyed by the parameter's name — untied copies included (``"rnn.W@3"``, ``"W@1.2"``).

* :func:`save` is atomic: it writes a temporary file in the target's directory, flushes and
  fsyncs it, then renames it over the target with ``os.replace``. A crash or an error mid-save
  never leaves a half-written checkpoint; the previous file stays intact and the temporary file
  is removed.
* :func:`load` reads and checks everything — the file, every name, shape and dtype — before it
  changes any parameter; on any problem it raises :class:`~vgraph.errors.CheckpointError` and the
  model is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from .compute import ComputeNode
from .errors import CheckpointError, ShapeError

__all__ = ["load", "read", "save"]


def _arrays(obj: Any) -> dict[str, np.ndarray]:
    from .virtual import VirtualGraph

    if isinstance(obj, VirtualGraph):
        obj = obj.params
    if not isinstance(obj, Mapping):
        raise TypeError(
            "save takes a VirtualGraph, a ParameterStore or a mapping name -> array, "
            f"got {type(obj).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"parameter names must be non-empty strings, got {name!r}")
        arr = np.asarray(value.value if isinstance(value, ComputeNode) else value)
        if arr.dtype.kind not in "fiub":
            raise TypeError(f"parameter {name!r}: cannot save dtype {arr.dtype}")
        out[name] = arr
    return out


def _write_npz(fileobj: Any, arrays: Mapping[str, np.ndarray]) -> None:
    # What np.savez does, minus its keyword-argument interface (a parameter named "file" would
    # collide with it): one ``<name>.npy`` member per array, never pickled.
    with zipfile.ZipFile(fileobj, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in arrays.items():
            with zf.open(name + ".npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.ascontiguousarray(arr), allow_pickle=False)


def _create_temp(directory: str, base: str) -> tuple[int, str]:
    """Create a new empty file next to the target. Mode 0o666 minus the umask, like any new file
    (``tempfile.mkstemp`` would make it 0o600)."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file in {directory!r}")


def _fsync_dir(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(params: Any, path: str | os.PathLike[str]) -> None:
    """Write parameter values to an ``.npz`` checkpoint at ``path``, atomically.

    The file is written exactly at ``path`` (no ``.npz`` suffix is added). The data goes to a
    temporary file in the same directory, which is fsynced and then renamed over ``path``; on any
    error the temporary file is removed, ``path`` is untouched, and the error propagates.

    Args:
        params: a :class:`~vgraph.virtual.VirtualGraph` (its ``params``), a
            :class:`~vgraph.virtual.ParameterStore`, or a mapping name -> node or array.
        path: the checkpoint file.

    Raises:
        TypeError: ``params`` is not one of those, or holds a non-numeric value.
        OSError: the directory is not writable, the disk is full …
    """
    arrays = _arrays(params)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)  # keep an existing file's permissions
    except OSError:
        mode = None
    fd, tmp = _create_temp(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            _write_npz(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def read(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read every array of a checkpoint (name -> array), without touching any model.

    Raises:
        CheckpointError: the file is missing, unreadable, not an ``.npz`` archive, corrupt
            (truncated, bad checksum), or holds pickled objects.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except FileNotFoundError as e:
        raise CheckpointError(f"no checkpoint at {path!r}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path!r}: {e}") from e
    if magic == b"\x93NUMPY":
        raise CheckpointError(f"{path!r} is a single .npy array, not an .npz checkpoint of named parameters")
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        what = "an empty file" if not magic else "not a zip archive"
        raise CheckpointError(f"{path!r} is not an .npz checkpoint ({what})")
    try:
        data = np.load(path, allow_pickle=False)
    except Exception as e:
        raise CheckpointError(f"{path!r} is not a readable .npz checkpoint: {e}") from e
    try:
        with data:
            return {name: np.asarray(data[name]) for name in data.files}
    except Exception as e:
        raise CheckpointError(f"{path!r} is corrupt: {e}") from e


def load(graph: Any, path: str | os.PathLike[str], strict: bool = True, cast: bool = False) -> None:
    """Set a model's parameters from a checkpoint, checking everything before changing anything.

    Untied entries (``"W@3"``) not yet in ``graph.params`` are created, as
    :meth:`VirtualGraph.load_state_dict` does.

    Args:
        graph: the :class:`~vgraph.virtual.VirtualGraph` to load into.
        path: the checkpoint file.
        strict: every parameter currently in ``graph.params`` must be in the checkpoint. Names in
            the checkpoint that are not parameters of the model are an error either way.
        cast: accept float arrays of another dtype and convert them to the model's (by default a
            dtype mismatch is an error).

    Raises:
        CheckpointError: a missing or corrupt file, an unknown name, (strict) a missing name, a
            shape mismatch, a non-float array, or (without ``cast``) a dtype mismatch. Nothing is
            changed when it is raised.
    """
    path = os.fspath(path)
    state = read(path)
    params = graph.params
    problems = []
    for name, arr in state.items():
        base, at, idx = name.partition("@")
        if at and not (base and all(p.isdigit() for p in idx.split("."))):
            problems.append(f"{name!r} is not a parameter name (an untied copy is 'name@<iteration path>')")
            continue
        expected = params[name].dtype if name in params else graph.dtype
        if arr.dtype.kind != "f":
            problems.append(f"{name!r} has dtype {arr.dtype}, not a float dtype")
        elif arr.dtype != expected:
            if cast:
                state[name] = arr.astype(expected)
            else:
                problems.append(
                    f"{name!r} has dtype {arr.dtype}, the model's is {expected} (pass cast=True to convert)"
                )
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: " + "; ".join(problems))
    try:
        graph.load_state_dict(state, strict=strict)
    except (KeyError, ShapeError, ValueError) as e:
        reason = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise CheckpointError(f"checkpoint {path!r} does not match the model: {reason}") from e
