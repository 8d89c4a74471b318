"""Parameter initialisers, reproducible from a seed.

Each factory returns an initialiser ``init(shape, rng, dtype) -> ndarray`` that draws only from the
numpy ``Generator`` it is given (never from global random state). Parameters take an initialiser,
its name as a string (``"xavier_uniform"``), or an array to start from.

Fans follow vgraph's ``x @ W`` convention: a weight of shape ``(fan_in, fan_out)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

Initializer = Callable[[tuple[int, ...], np.random.Generator, Any], np.ndarray]


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    return int(np.prod(shape[:-1])), shape[-1]


def zeros() -> Initializer:
    """All zeros (the usual choice for biases)."""
    return lambda shape, rng, dtype: np.zeros(shape, dtype=dtype)


def constant(value: float) -> Initializer:
    """Every element equal to ``value``."""
    return lambda shape, rng, dtype: np.full(shape, value, dtype=dtype)


def normal(std: float = 0.01, mean: float = 0.0) -> Initializer:
    """Independent normal draws with the given mean and standard deviation."""
    return lambda shape, rng, dtype: rng.normal(mean, std, size=shape).astype(dtype)


def uniform(low: float = -0.05, high: float = 0.05) -> Initializer:
    """Independent uniform draws in ``[low, high)``."""
    return lambda shape, rng, dtype: rng.uniform(low, high, size=shape).astype(dtype)


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """Glorot & Bengio (2010): uniform with variance ``2 / (fan_in + fan_out)`` times ``gain**2``."""

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        fan_in, fan_out = _fans(shape)
        bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-bound, bound, size=shape).astype(dtype)

    return init


def xavier_normal(gain: float = 1.0) -> Initializer:
    """Glorot & Bengio (2010): normal with variance ``2 / (fan_in + fan_out)`` times ``gain**2``."""

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        fan_in, fan_out = _fans(shape)
        return rng.normal(0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), size=shape).astype(dtype)

    return init


def kaiming_uniform(gain: float = math.sqrt(2.0)) -> Initializer:
    """He et al. (2015): uniform with variance ``gain**2 / fan_in`` (``gain=sqrt(2)`` suits ReLU)."""

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        fan_in, _ = _fans(shape)
        bound = gain * math.sqrt(3.0 / fan_in)
        return rng.uniform(-bound, bound, size=shape).astype(dtype)

    return init


def kaiming_normal(gain: float = math.sqrt(2.0)) -> Initializer:
    """He et al. (2015): normal with variance ``gain**2 / fan_in``."""

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        fan_in, _ = _fans(shape)
        return rng.normal(0.0, gain / math.sqrt(fan_in), size=shape).astype(dtype)

    return init


def orthogonal(gain: float = 1.0) -> Initializer:
    """Saxe et al. (2014): a (semi-)orthogonal matrix, a good start for recurrent weights."""

    def init(shape: tuple[int, ...], rng: np.random.Generator, dtype: Any) -> np.ndarray:
        if len(shape) < 2:
            raise ValueError(f"orthogonal initialisation needs at least 2 dimensions, got shape {shape}")
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        a = rng.standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q = q * np.sign(np.diag(r))  # make the decomposition unique (uniformly distributed q)
        if rows < cols:
            q = q.T
        return (gain * q).reshape(shape).astype(dtype)

    return init


_BY_NAME: dict[str, Callable[[], Initializer]] = {
    "zeros": zeros,
    "normal": normal,
    "uniform": uniform,
    "xavier_uniform": xavier_uniform,
    "glorot_uniform": xavier_uniform,
    "xavier_normal": xavier_normal,
    "glorot_normal": xavier_normal,
    "kaiming_uniform": kaiming_uniform,
    "he_uniform": kaiming_uniform,
    "kaiming_normal": kaiming_normal,
    "he_normal": kaiming_normal,
    "orthogonal": orthogonal,
}


def get(init: str | Initializer | None, shape: tuple[int, ...]) -> Initializer:
    """Resolve an initialiser given by name, or the default for ``shape`` when ``None``:
    ``xavier_uniform`` for weights (2+ dimensions), ``zeros`` for biases and scalars.

    Raises:
        ValueError: for an unknown name.
    """
    if init is None:
        return xavier_uniform() if len(shape) >= 2 else zeros()
    if isinstance(init, str):
        try:
            return _BY_NAME[init]()
        except KeyError:
            raise ValueError(f"unknown initialiser {init!r}; known: {', '.join(sorted(_BY_NAME))}") from None
    return init
