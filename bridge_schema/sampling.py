"""The contract for seeded sampling: a seeded output row draws its randomness from
(seed, position), so a request gives the same tokens alone or in any batch, and successive
decode steps with one seed still differ. Both drivers use this function.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# 0-d arrays, not numpy scalars: a ufunc takes them without a conversion per call (hot path).
_GOLDEN, _M1, _M2, _S11, _S27, _S30, _S31 = (
    np.array(n, dtype=np.uint64) for n in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 11, 27, 30, 31)
)


def _splitmix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer, in place on `z` (fewer temporaries on the drivers' hot path)."""
    # Wrapping uint64 array arithmetic is what we want (numpy only warns for scalars).
    z += _GOLDEN
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


# XTC's draw: a stream of its own, so it does not repeat the token draw's.
_XTC_SALT = np.uint64(0x9E3779B97F4A7C15)


def xtc_uniform(seeds: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """XTC's draw in [0, 1) per (seed, position) pair (seeds >= 0)."""
    salted = (np.array(seeds, dtype=np.int64, ndmin=1).astype(np.uint64) ^ _XTC_SALT) >> np.uint64(1)
    return seeded_uniform(salted.astype(np.int64), positions)


def seeded_uniform(seeds: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """One uniform draw in [0, 1) per (seed, position) pair; seeds must be >= 0."""
    bits = np.array(seeds, dtype=np.int64, ndmin=1).astype(np.uint64)
    _splitmix64(bits)
    bits = _splitmix64(bits ^ np.asarray(positions, dtype=np.int64).astype(np.uint64))  # broadcasts
    bits >>= _S11
    return bits.astype(np.float64) * (1.0 / (1 << 53))
