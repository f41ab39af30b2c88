"""The w8a8 kernel (`w8a8_kernel.cpp`): built once per machine with torch's C++ extension loader
(cached in torch's extension directory), registered as the opaque op `torch.ops.wafer.w8a8_linear`
(torch.compile calls it as is). Where it cannot be built, `load()` says why and returns False; the
caller then keeps the plain torch path, which gives the same results."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from drivers.torch.progress import Progress

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("w8a8_kernel.cpp")
_state: dict[str, bool] = {}  # "loaded": the outcome of the first `load()` of this process


def _fake(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, w_sum: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def load(show_progress: bool = True) -> bool:
    """Build (or find in the cache) and register the kernel; False, with a logged reason, where not."""
    if "loaded" not in _state:
        _state["loaded"] = _build(show_progress)
    return _state["loaded"]


def _build(show_progress: bool) -> bool:
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        log.warning("w8a8 kernel not built (ninja is not installed): w8a8 uses the torch path")
        return False
    # The name carries the source's hash: an edited kernel never loads a stale build.
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    progress = Progress("building the w8a8 kernel (cached for the next start)", 1, show_progress)
    progress.update(0)
    try:
        cpp_extension.load(
            f"wafer_w8a8_{digest}", [str(SOURCE)], extra_cflags=["-O3"], is_python_module=False, verbose=False
        )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, a failed build or load
        lines = str(exc).splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line), lines[0])
        log.warning("w8a8 kernel not built (%s): w8a8 uses the torch path", reason.strip())
        return False
    progress.update(1)
    torch.library.register_fake("wafer::w8a8_linear")(_fake)
    return True


def has_vnni() -> bool:
    """Whether the loaded kernel runs its AVX512-VNNI matrix-vector path (else `_int_mm` inside)."""
    return bool(torch.ops.wafer.w8a8_has_vnni())
