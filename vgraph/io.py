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
  generator's state, the graph's build counter (which seeds dropout masks) and your own
  ``extras`` (e.g. the state carried between truncated-BPTT chunks and the loss history). Still
  one ``.npz``: arrays as members, the rest as a JSON member; nothing is pickled. Every member is
  checked on loading; anything malformed is a :class:`~vgraph.errors.CheckpointError` naming it.
* A failed write (a full disk) raises an ``OSError`` naming the file, and replaces nothing.
"""

from __future__ import annotations

import json
import numbers
import os
import reprlib
import zipfile
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from ._files import write_atomically
from .compute import ComputeNode
from .errors import CheckpointError, ShapeError
from .modes import flag_arg, int_arg

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
        OSError: writing failed (a full disk: ``errno.ENOSPC``; an I/O error); its
            ``filename`` and message name ``path``, and ``path`` is as it was.
    """
    arrays = _arrays(params)
    write_atomically(_fspath(path), lambda f: _write_npz(f, arrays), "checkpoint")


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
    flag_arg(strict, "strict")
    flag_arg(cast, "cast")
    state = read(path)
    if _training_meta(state) is not None:
        raise CheckpointError(
            f"{path!r} is a training state (parameters, optimiser, ...): load it with io.load_training_state"
        )
    _load_params(graph, _checked_params(graph, state, path, cast), path, strict)


# ---------------------------------------------------------------------------- training state

# A training-state file's members: ``param/<name>``, ``optim/<name>/<array>``, ``extras/<n>`` and
# the JSON member _META. Parameter names are user data and live only under "param/" (and in the
# JSON, only as keys). In a parameters-only checkpoint any name is a parameter, also _META: there
# it is a float array, while a training state's _META is bytes (uint8), which no parameter can be
# (:func:`load` takes float arrays only). :func:`_training_meta` tells the two apart by that.
_META = "vgraph_training_state.json"
_FORMAT = "vgraph-training-state"
_VERSION = 2  # version 2 added "extras"; version 1 files load as they are
_KEYS = {"format", "version", "step", "graph_builds", "optimizer", "scheduler", "rng"}
_KEYS_BY_VERSION = {1: _KEYS, 2: _KEYS | {"extras"}}
_MAX_DEPTH = 32  # nesting levels of extras (and of a generator's state)


def _training_meta(arrays: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The JSON member (bytes) if ``arrays`` is a training state, else ``None``."""
    meta = arrays.get(_META)
    if meta is not None and meta.dtype == np.uint8 and meta.ndim == 1:
        return meta
    return None


def _at(path: str, key: str | int) -> str:
    """The path of a member's element, e.g. ``extras["losses"][3]``."""
    return f"{path}[{json.dumps(key) if isinstance(key, str) else key}]"


def _kind(value: Any) -> str:
    """What a JSON value is, for messages (never the whole value: it may be huge or deep)."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return f"the string {value[:40]!r}{'…' if len(value) > 40 else ''}"
    return "null" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


def _object(value: Any, path: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected an object ({what}), got {_kind(value)}")
    return value


# -- extras: the user's own values (JSON values and numpy arrays), kept apart from ours

_EXTRAS_KINDS = "None, bool, int, float, str, lists, dicts with str keys and numpy arrays"


def _encode_extras(extras: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``extras`` as a JSON tree plus its arrays (member ``extras/<n>``).

    In the tree a JSON object is always a tag: ``{"dict": {...}}`` for a dict (so the user's keys
    never mix with ours) or ``{"array": n}`` for an array; lists and scalars are themselves.

    Raises:
        TypeError: not a mapping, a non-str key, a value of another type, an object array.
        ValueError: a NaN or infinite float (JSON has none: keep such values in an array), or
            nesting deeper than 32 levels (or a cycle).
    """
    if not isinstance(extras, Mapping):
        raise TypeError(f"extras must be a mapping str -> value, got {type(extras).__name__}")
    arrays: dict[str, np.ndarray] = {}

    def encode(value: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"{path}: extras nested deeper than {_MAX_DEPTH} levels (or a cycle)")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, np.bool_):
            return bool(value)
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, (float, np.floating)):
            if not np.isfinite(value):
                raise ValueError(
                    f"{path}: {float(value)} is not finite; JSON has no NaN or infinity, "
                    "keep such values in a numpy array"
                )
            return float(value)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError(f"{path}: cannot save an array of dtype {value.dtype} (it would be pickled)")
            arrays[f"extras/{len(arrays)}"] = value
            return {"array": len(arrays) - 1}
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"{path}: keys must be str, got {type(k).__name__} {k!r}")
                out[k] = encode(v, _at(path, k), depth + 1)
            return {"dict": out}
        if isinstance(value, (list, tuple)):
            return [encode(v, _at(path, i), depth + 1) for i, v in enumerate(value)]
        raise TypeError(f"{path}: cannot save a {type(value).__name__}; extras hold {_EXTRAS_KINDS}")

    return encode(extras, "extras", 0), arrays


def _decode_extras(tree: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The inverse of :func:`_encode_extras`, checking everything (each array used exactly once).

    Raises:
        ValueError: naming the path of the first element that is not what the encoding writes.
    """
    used: set[str] = set()

    def decode(value: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [decode(v, _at(path, i), depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict) and len(value) == 1:
            ((tag, body),) = value.items()
            if tag == "dict" and isinstance(body, dict):
                return {k: decode(v, _at(path, k), depth + 1) for k, v in body.items()}
            if tag == "array" and isinstance(body, int) and not isinstance(body, bool):
                key = f"extras/{body}"
                if key not in arrays or key in used:
                    lacks = "which the file lacks" if key not in arrays else "used twice"
                    raise ValueError(f"{path}: refers to the array member {key!r}, {lacks}")
                used.add(key)
                return arrays[key]
        raise ValueError(
            f'{path}: expected null, a boolean, a number, a string, an array, {{"dict": {{...}}}} or '
            f'{{"array": <index>}}, got {_kind(value)}'
        )

    if not (isinstance(tree, dict) and set(tree) == {"dict"}):
        raise ValueError(f'extras: expected {{"dict": {{...}}}}, got {_kind(tree)}')
    out = decode(tree, "extras", 0)
    unused = sorted(set(arrays) - used)
    if unused:
        raise ValueError(f"array member(s) {unused} are not part of extras")
    return out  # type: ignore[no-any-return]


# -- a numpy bit generator's state


def _encode(obj: Any) -> Any:
    """A bit generator's state as JSON values: arrays become {"__ndarray__": list, "dtype": str}."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, Mapping):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _decode_rng(obj: Any, path: str = "rng", depth: int = 0) -> Any:
    """The inverse of :func:`_encode` for a bit generator's state: objects, ints, strings, and
    integer arrays (numpy's states hold nothing else).

    Raises:
        ValueError: naming the path of the first element that is none of those.
    """
    if depth > _MAX_DEPTH:
        raise ValueError(f"{path}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if set(obj) == {"__ndarray__", "dtype"}:
            items, dtype = obj["__ndarray__"], obj["dtype"]
            if dtype not in ("uint32", "uint64", "int64") or not isinstance(items, list):
                raise ValueError(
                    f"{path}: expected an integer array, got dtype {_kind(dtype)} and {_kind(items)}"
                )
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
                raise ValueError(f"{path}: expected a flat array of integers")
            try:
                return np.array(items, dtype=dtype)
            except OverflowError as e:
                raise ValueError(f"{path}: {e}") from e
        return {k: _decode_rng(v, _at(path, k), depth + 1) for k, v in obj.items()}
    if obj is None or isinstance(obj, (int, str)):
        return obj
    raise ValueError(f"{path}: expected an object, an integer or a string, got {_kind(obj)}")


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
    extras: Mapping[str, Any] | None = None,
) -> None:
    """Save everything needed to resume training, atomically, to one ``.npz`` file.

    Members: ``param/<name>`` (every parameter, untied copies included), ``optim/<name>/<array>``
    (the optimiser's per-parameter arrays), ``extras/<n>`` (the arrays of ``extras``) and one
    JSON member holding the optimiser's hyper-parameters and step counts, the schedule's state,
    ``step``, the state of ``rng``, the graph's build counter (the seed of dropout masks) and the
    rest of ``extras``. Nothing is pickled. Written like :func:`save`: temporary file, fsync, rename.

    Args:
        graph: the :class:`~vgraph.virtual.VirtualGraph`.
        path: the file to write.
        optimizer: a :mod:`vgraph.optim` optimiser, or ``None``.
        scheduler: a learning-rate schedule of ``optimizer``, or ``None``.
        step: your step (or epoch) counter, an int >= 0, returned by :func:`load_training_state`;
            or ``None``.
        rng: a ``numpy.random.Generator`` whose state to save (the one that draws your batches).
        extras: anything else your run needs to resume, by name: ``None``, bools, ints, finite
            floats, strings, lists (tuples come back as lists), dicts with str keys, and numpy
            arrays (any dtype but object; they come back with their dtype and shape, bit for
            bit), nested up to 32 levels — e.g. the recurrent state carried between truncated-BPTT
            chunks, the chunk to resume at and the loss history. numpy scalars are saved as
            Python numbers.

    Raises:
        TypeError: an argument of the wrong type, or an ``extras`` value that cannot be saved
            (the message gives its path, e.g. ``extras["history"][3]``). ValueError: a negative
            ``step``, a schedule of another optimiser, a non-finite float in ``extras`` (keep
            those in an array) or ``extras`` nested too deeply. PermissionError / OSError: as
            :func:`save`.
    """
    _check_graph(graph)
    path = _fspath(path)
    _check_components(optimizer, scheduler, rng)
    step = int_arg(step, "step", 0, optional=True)
    extras_tree, extras_arrays = (None, {}) if extras is None else _encode_extras(extras)
    arrays: dict[str, np.ndarray] = {f"param/{k}": v for k, v in graph.params.state_dict().items()}
    meta: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "step": step,
        "graph_builds": int_arg(graph.build_count, "graph_builds", 0),
        "optimizer": None,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": None if rng is None else _encode(rng.bit_generator.state),
        "extras": extras_tree,
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
    arrays.update(extras_arrays)
    text = json.dumps(meta, allow_nan=False, sort_keys=True)
    arrays[_META] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    write_atomically(path, lambda f: _write_npz(f, arrays), "checkpoint")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _read_meta(raw: np.ndarray) -> dict[str, Any]:
    """The JSON member parsed and its top level checked (format, version, members).

    Raises:
        ValueError: naming what is wrong (nesting too deep included).
    """
    try:
        meta = json.loads(raw.tobytes().decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("its JSON member is nested too deeply to be ours") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"its JSON member is corrupt: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"its JSON member is {_kind(meta)}, not an object")
    version = meta.get("version")
    if meta.get("format") != _FORMAT or type(version) is not int or version not in _KEYS_BY_VERSION:
        raise ValueError(f"unknown format or version ({_kind(meta.get('format'))}, version {_kind(version)})")
    keys = _KEYS_BY_VERSION[version]
    if set(meta) != keys:
        missing, unknown = sorted(keys - set(meta)), sorted(set(meta) - keys)
        raise ValueError(f"its JSON member lacks {missing} / has unknown members {unknown}")
    meta.setdefault("extras", None)
    return meta


def _optimizer_state_dict(om: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The optimiser's state dict rebuilt from the JSON member ``optimizer`` and the ``optim/``
    members, with its structure checked (the values are the optimiser's to check).

    Raises:
        ValueError: naming the member path that is wrong.
    """
    om = _object(om, "optimizer", "the optimiser's class, hyper-parameters and step counts")
    if set(om) != {"optimizer", "hyperparameters", "steps"}:
        raise ValueError(
            f"optimizer: expected the members hyperparameters, optimizer, steps; got {sorted(om)}"
        )
    if not isinstance(om["optimizer"], str):
        raise ValueError(f"optimizer.optimizer: expected a class name, got {_kind(om['optimizer'])}")
    hyper = _object(om["hyperparameters"], "optimizer.hyperparameters", "name -> value")
    steps = _object(om["steps"], "optimizer.steps", "parameter name -> step count")
    state: dict[str, dict[str, Any]] = {name: {"step": n} for name, n in steps.items()}
    for key, arr in arrays.items():
        name, _, k = key.rpartition("/")
        if name not in state:
            raise ValueError(f"member 'optim/{key}': state of a parameter with no step in optimizer.steps")
        state[name][k] = arr
    return {"optimizer": om["optimizer"], "hyperparameters": hyper, "state": state}


def load_training_state(
    graph: Any,
    path: str | os.PathLike[str],
    optimizer: Any = None,
    scheduler: Any = None,
    rng: np.random.Generator | None = None,
    strict: bool = True,
    extras: dict[str, Any] | None = None,
) -> int | None:
    """Restore a :func:`save_training_state` file, checking all of it before changing anything.

    Parameters are loaded as :func:`load` does (untied copies created); the optimiser's state is
    matched to its parameters by name (:meth:`vgraph.optim.Optimizer.load_state_dict`); the
    schedule, ``rng`` (in place), ``extras`` (in place) and the graph's build counter are
    restored. Continuing then gives bit for bit the run that was never interrupted, also in a
    fresh process.

    Args:
        graph: the model, declared as when saving.
        path: the file.
        optimizer: the optimiser to restore (same class), or ``None``.
        scheduler: the schedule to restore (same class), or ``None``.
        rng: the ``numpy.random.Generator`` to restore (same bit generator), or ``None``.
        strict: every parameter of the model must be in the file, every component the file
            holds (optimiser, schedule, rng, extras) must be given, and the optimiser must update
            every parameter the file holds optimiser state for; with ``False`` the rest is
            ignored. Asking for a component the file does not hold is an error either way.
        extras: a dict to fill with the saved ``extras`` (cleared first), or ``None``.

    Returns:
        The ``step`` that was saved (``None`` if none was).

    Raises:
        TypeError: an argument of the wrong type.
        CheckpointError: a missing or corrupt file, not a training state, any malformed member
            (the message names its path, e.g. ``optimizer.steps["W"]`` or
            ``extras["carry"]``), or any mismatch with the model, optimiser, schedule or
            generator (the message says which). Nothing is changed when it is raised.
    """
    _check_graph(graph)
    path = _fspath(path)
    _check_components(optimizer, scheduler, rng)
    flag_arg(strict, "strict")
    if extras is not None and not isinstance(extras, MutableMapping):
        raise TypeError(f"extras must be a dict to fill (or None), got {type(extras).__name__}")
    arrays = read(path)

    def fail(reason: str) -> CheckpointError:
        return CheckpointError(f"training state {path!r}: {reason}")

    raw = _training_meta(arrays)
    if raw is None:
        raise fail("not a training state (a parameters-only checkpoint? load it with io.load)")
    del arrays[_META]
    groups: dict[str, dict[str, np.ndarray]] = {"param/": {}, "optim/": {}, "extras/": {}}
    unknown = []
    for key, arr in arrays.items():
        prefix = next((p for p in groups if key.startswith(p)), None)
        if prefix is None:
            unknown.append(key)
        elif prefix == "extras/":
            groups[prefix][key] = arr
        else:
            groups[prefix][key[len(prefix) :]] = arr
    if unknown:
        raise fail(f"unknown members {unknown}")
    try:
        meta = _read_meta(raw)
        step = int_arg(meta["step"], "step", 0, optional=True)
        builds = int_arg(meta["graph_builds"], "graph_builds", 0)
        optim_sd = (
            None if meta["optimizer"] is None else _optimizer_state_dict(meta["optimizer"], groups["optim/"])
        )
        if optim_sd is None and groups["optim/"]:
            raise ValueError(f"optimiser arrays {sorted(groups['optim/'])} but no optimizer state")
        if meta["scheduler"] is not None:
            _object(meta["scheduler"], "scheduler", "the schedule's state")
        rng_state = (
            None
            if meta["rng"] is None
            else _decode_rng(_object(meta["rng"], "rng", "a bit generator's state"))
        )
        saved_extras = None
        if meta["extras"] is not None or groups["extras/"]:
            saved_extras = _decode_extras(meta["extras"], groups["extras/"])
    except (TypeError, ValueError) as e:
        raise fail(str(e)) from e

    wanted = {"optimizer": optimizer, "scheduler": scheduler, "rng": rng, "extras": extras}
    for what, given in wanted.items():
        held = meta[what] is not None
        if given is not None and not held:
            raise fail(f"it holds no {what} state, but {what}= was given")
        if strict and held and given is None:
            raise fail(f"it holds {what} state; pass {what}= to restore it (or strict=False to ignore it)")

    params = _checked_params(graph, groups["param/"], path, cast=False)
    if optimizer is not None:
        try:
            optimizer._prepare_load(optim_sd, strict)
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"the optimiser state does not match: {e.args[0] if e.args else e}") from e
    if scheduler is not None:
        try:
            scheduler._prepare_load(meta["scheduler"])
        except (TypeError, ValueError) as e:
            raise fail(f"the schedule state does not match: {e}") from e
    if rng is not None:
        try:
            scratch = type(rng.bit_generator)()
            scratch.state = rng_state  # type: ignore[assignment]  # numpy checks the bit generator's name and the state's form
        except Exception as e:  # numpy's setter raises TypeError, ValueError, KeyError, OverflowError
            raise fail(
                f"the random generator state does not match {type(rng.bit_generator).__name__}: "
                f"{type(e).__name__}: {e}"
            ) from e

    _load_params(graph, params, path, strict)  # checks names and shapes before changing anything
    # Everything below was checked above and cannot fail.
    if optimizer is not None and optim_sd is not None:
        optimizer.load_state_dict(optim_sd, strict)
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if rng is not None and rng_state is not None:
        rng.bit_generator.state = rng_state
    if extras is not None and saved_extras is not None:
        extras.clear()
        extras.update(saved_extras)
    graph.build_count = builds
    return step
