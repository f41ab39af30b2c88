"""The contract for seeded sampling: a seeded output row draws its randomness from
(seed, position), so a request gives the same tokens alone or in any batch, and successive
decode steps with one seed still differ. Both drivers use this function.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def seeded_uniform(seeds: npt.ArrayLike, positions: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """One uniform draw in [0, 1) per (seed, position) pair; seeds must be >= 0."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    bits = _splitmix64(_splitmix64(s) ^ p)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
