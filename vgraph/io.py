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
* :func:`save_training_state` / :func:`load_training_state` do the same for everything a run needs
  to resume bit for bit: parameters, optimiser state, schedule, step counter, a numpy random
  generator's state and the graph's build counter (which seeds dropout masks). Still one ``.npz``:
  arrays as members, the rest as a JSON member; nothing is pickled.
"""

from __future__ import annotations

import contextlib
import errno
import json
import numbers
import os
import secrets
import stat
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from .compute import ComputeNode
from .errors import CheckpointError, ShapeError

__all__ = ["load", "load_training_state", "read", "save", "save_training_state"]

# The member of a training-state file that holds everything that is not an array (JSON text).
_META = "vgraph_training_state.json"
_FORMAT = "vgraph-training-state"


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


def _fspath(path: Any, what: str = "path") -> str:
    """``os.fspath(path)`` as a str, with a TypeError naming the argument."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise TypeError(f"{what} must be a str or os.PathLike, got {type(path).__name__} {path!r}") from None


def _create_temp(directory: str, base: str) -> tuple[int, str]:
    """Create a new empty file next to the target. Mode 0o666 minus the umask, like any new file
    (``tempfile.mkstemp`` would make it 0o600). Its name holds our process id, so that a later
    save can tell a temporary file of a killed save from one being written right now."""
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file in {directory!r}")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # os.kill(pid, 0) is not a probe on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, but is another user's
    return True


def _remove_stale_temps(directory: str, base: str) -> None:
    """Remove temporary files that a killed save of the same target left behind: those whose
    writer process no longer exists. A save in progress (another live process) is left alone."""
    prefix = f".{base}."
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        tag = name[len(prefix) : -len(".tmp")]
        pid_text, dash, token = tag.partition("-")
        if dash and pid_text.isdigit() and len(token) == 12:
            pid = int(pid_text)
            if pid == os.getpid() or _pid_alive(pid):
                continue
        elif not (len(tag) == 12 and all(c in "0123456789abcdef" for c in tag)):
            continue  # not a name we make (vgraph 0.1 made ".<base>.<12 hex>.tmp")
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))


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

    A temporary file left by an earlier save of the same ``path`` that was killed is removed.

    Raises:
        TypeError: ``params`` is not one of those, or holds a non-numeric value; ``path`` is not a
            path.
        PermissionError: ``path`` exists and is read-only (as ``np.save`` does; nothing is
            replaced), or its directory is not writable.
        OSError: the disk is full …
    """
    arrays = _arrays(params)
    _atomic_write(_fspath(path), arrays)


def _atomic_write(path: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` as an ``.npz`` at ``path`` through a temporary file and a rename.

    Raises:
        PermissionError: ``path`` exists and is read-only, or the directory is not writable.
        IsADirectoryError: ``path`` is a directory. OSError: other I/O failures.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Is a directory, not a checkpoint file", path)
    try:
        mode: int | None = stat.S_IMODE(os.stat(path).st_mode)  # keep an existing file's permissions
    except OSError:
        mode = None
    if mode is not None and not os.access(path, os.W_OK):
        # np.save / torch.save open the file for writing and fail; replacing it by a rename would
        # silently overwrite a file its owner protected.
        raise PermissionError(
            errno.EACCES, "Permission denied: the checkpoint is read-only, not replaced", path
        )
    _remove_stale_temps(directory, os.path.basename(path))
    try:
        fd, tmp = _create_temp(directory, os.path.basename(path))
    except PermissionError as e:
        raise PermissionError(
            errno.EACCES, "Permission denied: cannot create a file in the directory", path
        ) from e
    except FileNotFoundError as e:
        raise FileNotFoundError(errno.ENOENT, "No such directory to save the checkpoint in", path) from e
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
        TypeError: ``path`` is not a path.
    """
    path = _fspath(path)
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


def _check_graph(graph: Any) -> None:
    from .virtual import VirtualGraph

    if not isinstance(graph, VirtualGraph):
        raise TypeError(
            f"graph must be a VirtualGraph (the model to load into), got {type(graph).__name__} {graph!r}"
        )


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _checked_params(graph: Any, state: dict[str, np.ndarray], path: str, cast: bool) -> dict[str, np.ndarray]:
    """The parameter arrays of a checkpoint after the dtype checks (cast if asked); names and
    shapes are checked by ``graph.load_state_dict``. Changes nothing.

    Raises:
        CheckpointError: listing every problem found.
    """
    params = graph.params
    problems = []
    out = dict(state)
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
                out[name] = arr.astype(expected)
            else:
                problems.append(
                    f"{name!r} has dtype {arr.dtype}, the model's is {expected} (pass cast=True to convert)"
                )
    if problems:
        raise CheckpointError(f"checkpoint {path!r} does not match the model: " + "; ".join(problems))
    return out


def _load_params(graph: Any, state: dict[str, np.ndarray], path: str, strict: bool) -> None:
    try:
        graph.load_state_dict(state, strict=strict)
    except (KeyError, ShapeError, ValueError) as e:
        reason = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise CheckpointError(f"checkpoint {path!r} does not match the model: {reason}") from e


def load(graph: Any, path: str | os.PathLike[str], strict: bool = True, cast: bool = False) -> None:
    """Set a model's parameters from a checkpoint, checking everything before changing anything.

    Untied entries (``"W@3"``) not yet in ``graph.params`` are created, as
    :meth:`VirtualGraph.load_state_dict` does. A training-state file
    (:func:`save_training_state`) is refused here: load it with :func:`load_training_state`.

    Args:
        graph: the :class:`~vgraph.virtual.VirtualGraph` to load into.
        path: the checkpoint file.
        strict: every parameter currently in ``graph.params`` must be in the checkpoint. Names in
            the checkpoint that are not parameters of the model are an error either way.
        cast: accept float arrays of another dtype and convert them to the model's (by default a
            dtype mismatch is an error).

    Raises:
        TypeError: ``graph`` is not a VirtualGraph, ``path`` not a path, or a flag not a bool.
        CheckpointError: a missing or corrupt file, an unknown name, (strict) a missing name, a
            shape mismatch, a non-float array, or (without ``cast``) a dtype mismatch. Nothing is
            changed when it is raised.
    """
    _check_graph(graph)
    path = _fspath(path)
    _check_flag("strict", strict)
    _check_flag("cast", cast)
    state = read(path)
    if _META in state:
        raise CheckpointError(
            f"{path!r} is a training state (parameters, optimiser, ...): load it with io.load_training_state"
        )
    _load_params(graph, _checked_params(graph, state, path, cast), path, strict)


# ---------------------------------------------------------------------------- training state


def _encode(obj: Any) -> Any:
    """A bit generator's state as JSON values: arrays become {"__ndarray__": list, "dtype": str}."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, Mapping):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__ndarray__", "dtype"}:
            return np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        return {k: _decode(v) for k, v in obj.items()}
    return obj


def _check_rng(rng: Any) -> None:
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator (np.random.default_rng()), got {type(rng).__name__}"
        )


def _check_components(optimizer: Any, scheduler: Any, rng: Any) -> None:
    from .optim import LRScheduler, Optimizer

    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer must be a vgraph.optim optimiser, got {type(optimizer).__name__}")
    if scheduler is not None:
        if not isinstance(scheduler, LRScheduler):
            raise TypeError(f"scheduler must be a vgraph.optim schedule, got {type(scheduler).__name__}")
        if optimizer is not None and scheduler.optimizer is not optimizer:
            raise ValueError("scheduler drives another optimiser than the optimizer given")
    _check_rng(rng)


def save_training_state(
    graph: Any,
    path: str | os.PathLike[str],
    optimizer: Any = None,
    scheduler: Any = None,
    step: int | None = None,
    rng: np.random.Generator | None = None,
) -> None:
    """Save everything needed to resume training, atomically, to one ``.npz`` file.

    Members: ``param/<name>`` (every parameter, untied copies included), ``optim/<name>/<array>``
    (the optimiser's per-parameter arrays) and one JSON member holding the optimiser's
    hyper-parameters and step counts, the schedule's state, ``step``, the state of ``rng`` and the
    graph's build counter (the seed of dropout masks). Nothing is pickled. Written like
    :func:`save`: temporary file, fsync, rename.

    Args:
        graph: the :class:`~vgraph.virtual.VirtualGraph`.
        path: the file to write.
        optimizer: a :mod:`vgraph.optim` optimiser, or ``None``.
        scheduler: a learning-rate schedule of ``optimizer``, or ``None``.
        step: your step (or epoch) counter, returned by :func:`load_training_state`; ``None``.
        rng: a ``numpy.random.Generator`` whose state to save (the one that draws your batches).

    Raises:
        TypeError: an argument of the wrong type. ValueError: a negative ``step``, or a schedule
            of another optimiser. PermissionError / OSError: as :func:`save`.
    """
    _check_graph(graph)
    path = _fspath(path)
    _check_components(optimizer, scheduler, rng)
    if step is not None:
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int >= 0 or None, got {type(step).__name__} {step!r}")
        if step < 0:
            raise ValueError(f"step must be an int >= 0 or None, got {step}")
    arrays: dict[str, np.ndarray] = {f"param/{k}": v for k, v in graph.params.state_dict().items()}
    meta: dict[str, Any] = {
        "format": _FORMAT,
        "version": 1,
        "step": None if step is None else int(step),
        "graph_builds": int(graph._builds),
        "optimizer": None,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": None if rng is None else _encode(rng.bit_generator.state),
    }
    if optimizer is not None:
        sd = optimizer.state_dict()
        steps = {}
        for name, entry in sd["state"].items():
            steps[name] = int(entry["step"])
            for k, v in entry.items():
                if k != "step":
                    arrays[f"optim/{name}/{k}"] = v
        meta["optimizer"] = {
            "optimizer": sd["optimizer"],
            "hyperparameters": sd["hyperparameters"],
            "steps": steps,
        }
    text = json.dumps(meta, allow_nan=False, sort_keys=True)
    arrays[_META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    _atomic_write(path, arrays)


def load_training_state(
    graph: Any,
    path: str | os.PathLike[str],
    optimizer: Any = None,
    scheduler: Any = None,
    rng: np.random.Generator | None = None,
    strict: bool = True,
) -> int | None:
    """Restore a :func:`save_training_state` file, checking all of it before changing anything.

    Parameters are loaded as :func:`load` does (untied copies created); the optimiser's state is
    matched to its parameters by name (:meth:`vgraph.optim.Optimizer.load_state_dict`); the
    schedule, ``rng`` (in place) and the graph's build counter are restored. Continuing then gives
    bit for bit the run that was never interrupted, also in a fresh process.

    Args:
        graph: the model, declared as when saving.
        path: the file.
        optimizer: the optimiser to restore (same class), or ``None``.
        scheduler: the schedule to restore (same class), or ``None``.
        rng: the ``numpy.random.Generator`` to restore (same bit generator), or ``None``.
        strict: every parameter of the model must be in the file, and every component the file
            holds (optimiser, schedule, rng) must be given. Asking for a component the file does not
            hold is an error either way.

    Returns:
        The ``step`` that was saved (``None`` if none was).

    Raises:
        TypeError: an argument of the wrong type.
        CheckpointError: a missing or corrupt file, not a training state, or any mismatch with
            the model, optimiser, schedule or generator (the message says which). Nothing is
            changed when it is raised.
    """
    _check_graph(graph)
    path = _fspath(path)
    _check_components(optimizer, scheduler, rng)
    _check_flag("strict", strict)
    arrays = read(path)

    def fail(reason: str) -> CheckpointError:
        return CheckpointError(f"training state {path!r}: {reason}")

    if _META not in arrays:
        raise fail("not a training state (a parameters-only checkpoint? load it with io.load)")
    try:
        meta = json.loads(arrays.pop(_META).tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise fail(f"its JSON member is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != 1:
        raise fail("unknown format or version")
    params = {k[len("param/") :]: v for k, v in arrays.items() if k.startswith("param/")}
    optim_arrays = {k[len("optim/") :]: v for k, v in arrays.items() if k.startswith("optim/")}
    unknown = [k for k in arrays if not k.startswith(("param/", "optim/"))]
    if unknown:
        raise fail(f"unknown members {unknown}")

    wanted = {"optimizer": optimizer, "scheduler": scheduler, "rng": rng}
    for what, given in wanted.items():
        held = meta.get(what) is not None
        if given is not None and not held:
            raise fail(f"it holds no {what} state, but {what}= was given")
        if strict and held and given is None:
            raise fail(f"it holds {what} state; pass {what}= to restore it (or strict=False to ignore it)")

    params = _checked_params(graph, params, path, cast=False)

    # The optimiser's state dict, rebuilt from the JSON member and its arrays, checked against the
    # parameters as they will be after loading (an untied copy may exist only in the file).
    optim_sd = None
    if optimizer is not None:
        om = meta["optimizer"]
        try:
            state: dict[str, dict[str, Any]] = {name: {"step": n} for name, n in om["steps"].items()}
            for key, arr in optim_arrays.items():
                name, _, k = key.rpartition("/")
                if name not in state:
                    raise KeyError(f"optimiser array {key!r} of a parameter with no step count")
                state[name][k] = arr
            optim_sd = {
                "optimizer": om["optimizer"],
                "hyperparameters": om["hyperparameters"],
                "state": state,
            }
            store = graph.params
            shapes = {k: (v.shape, store[k].dtype if k in store else graph.dtype) for k, v in params.items()}
            optimizer._prepare_load(optim_sd, shapes)
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"the optimiser state does not match: {e.args[0] if e.args else e}") from e
    if scheduler is not None:
        try:
            scheduler._prepare_load(meta["scheduler"])
        except (TypeError, ValueError) as e:
            raise fail(f"the schedule state does not match: {e}") from e
    rng_state = None
    if rng is not None:
        try:
            rng_state = _decode(meta["rng"])
            scratch = type(rng.bit_generator)()
            scratch.state = rng_state  # numpy checks the bit generator's name and the state's form
        except (KeyError, TypeError, ValueError) as e:
            raise fail(
                f"the random generator state does not match {type(rng.bit_generator).__name__}: {e}"
            ) from e
    builds = meta.get("graph_builds")
    if isinstance(builds, bool) or not isinstance(builds, int) or builds < 0:
        raise fail(f"bad graph build counter {builds!r}")
    step = meta.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise fail(f"bad step {step!r}")

    _load_params(graph, params, path, strict)  # checks names and shapes before changing anything
    # Everything below was checked above and cannot fail.
    if optimizer is not None and optim_sd is not None:
        optimizer.load_state_dict(optim_sd)
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if rng is not None and rng_state is not None:
        rng.bit_generator.state = rng_state
    graph._builds = builds
    return step
