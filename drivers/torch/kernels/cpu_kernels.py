"""wafer's C++ CPU kernels, built once per machine with torch's C++ extension loader (cached in
torch's extension directory) and registered as opaque ops that torch.compile calls as they are:

- `torch.ops.wafer.w8a8_linear` (`w8a8_kernel.cpp`): int8 weights in panels
  (`quantize.pack_vnni`) times per-row int8 activations, bit-identical to `DynamicInt8Linear`'s
  torch path; `w8a8_linear_packed`, the same with the weights, scales and sums in one tensor;
- `torch.ops.wafer.decode_attention` (`decode_attention.cpp`): float32 attention of one query per
  request over keys read in place from the paged cache (`paged_attention.attend_keys`);
- `torch.ops.wafer.argmax_rows` (`argmax.cpp`): each row's first maximum, for greedy sampling
  (`argmax_rows` below);
- `torch.ops.wafer.sample_rows` (`sample.cpp`): random sampling of chosen rows, the steps of
  `sampling.py`'s torch path in one pass over each row (`sample_rows` below);
- and, not an op, `pass_planner()` (`pass_plan.cpp`, the build loaded as a Python module): a
  pass's checks, layout and attention keys from the request's numpy arrays in one call, the same
  arrays as batch_plan.py's numpy code.

Each kernel holds variants for several instruction sets (`cpu_features.h`: avx512_vnni, avx512,
avx2_vnni, avx2, portable) and runs the best one the CPU has at each call; `variants()` says which,
`limit_isa` caps them (tests and benches run the lower variants on a CPU that has higher ones).
Where they cannot be built, `load()` says why and returns False; callers then keep the plain
torch paths, which give the same results (to float32 rounding, for attention)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from drivers.torch.progress import ticking

log = logging.getLogger(__name__)
SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_isa.cpp",
        "w8a8_kernel.cpp",
        "f32_matvec.cpp",
        "decode_attention.cpp",
        "argmax.cpp",
        "sample.cpp",
        "decode_step.cpp",
        "pass_plan.cpp",
    )
)
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_features.h", "w8a8_avx2.inc", "step_parts.h", "vec_math.h"))
ISAS = ("portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni")  # cpu_features.h's levels, lowest first
KERNELS = ("w8a8", "decode_attention", "argmax", "sample", "f32_linear")
# -fopenmp: ATen's `parallel_for` is OpenMP in headers; without it the kernels run on one thread.
FLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# Kernel development: WAFER_SANITIZE=address builds them with AddressSanitizer (a build of its own,
# since the flags are part of its name), for a Python that preloads libasan (`make asan-check`).
if os.environ.get("WAFER_SANITIZE") == "address":
    FLAGS = ["-fopenmp", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address"]
    LDFLAGS = ["-fopenmp", "-fsanitize=address"]
_state: dict[str, bool] = {}  # "loaded": the outcome of the first `load()` of this process
_module: list[ModuleType] = []  # the build as a Python module (`pass_plan.cpp`'s functions), once loaded


def _fake_linear(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, w_sum: torch.Tensor, sgemm_from_rows: int = 0
) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_scale.shape[0])  # w: VNNI panels, one scale per output


def _fake_linear_packed(x: torch.Tensor, packed: torch.Tensor, n: int, sgemm_from_rows: int = 0) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def _fake_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_index: torch.Tensor,
    mask: torch.Tensor,
    empty: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _fake_f32_linear(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_t.shape[1])


def _fake_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.int64)


def load(show_progress: bool = True) -> bool:
    """Build (or find in the cache) and register the kernels; False, with a logged reason, where not."""
    if "loaded" not in _state:
        _state["loaded"] = _build(show_progress)
    return _state["loaded"]


def source_digest() -> str:
    """A hash of the kernels' sources: names the build, and keys compiled graphs that call them."""
    data = b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()
    return hashlib.sha256(data).hexdigest()[:12]


def build_directory(name: str) -> Path:
    """Where the build named `name` is cached: torch's extension root (TORCH_EXTENSIONS_DIR, or
    its default), one folder per Python version and torch install."""
    from torch.utils import cpp_extension

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    # torch's loader reads TORCH_EXTENSIONS_DIR itself; `get_default_build_root` does not.
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    # Two venvs of the same torch version compile with different include paths: one folder each
    # (sharing one, each start from the other venv rebuilt it; see `staged_sources`).
    where = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    directory = Path(root) / f"{name}-{python}-torch{torch.__version__}-{where}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def _one_builder(directory: Path) -> Iterator[None]:
    """One build at a time across processes, under an flock: the OS releases it when its holder
    dies, where torch's own lock file (`lock` in the build folder) stays behind a build killed
    halfway and blocks every later start forever. Found while the flock is held, that file is such
    a leftover, and goes."""
    with open(directory.with_name(directory.name + ".lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def staged_sources(directory: Path) -> list[Path]:
    """The kernels' sources and headers copied into `directory / "src"` (each written only where
    its bytes differ, so an unchanged copy keeps its time stamp); returns the sources' copies.
    The build compiles the copies: ninja rebuilds whenever a source's path in its command changes,
    and two checkouts of the same sources (a worktree, a CI clone) share the build by name, so
    built from their own paths they rebuilt it in turn, ~1 minute at every other start."""
    src = directory / "src"
    src.mkdir(exist_ok=True)
    for path in (*SOURCES, *HEADERS):
        data, copy = path.read_bytes(), src / path.name
        if not copy.exists() or copy.read_bytes() != data:
            tmp = copy.with_name(copy.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(copy)
    return [src / path.name for path in SOURCES]


def ninja_on_path() -> None:
    """Put the `ninja` package's binary (a dependency of the torch extra) on PATH if no ninja is
    there: torch's loader runs `ninja` from PATH, and a venv's bin folder is on PATH only when the
    venv is activated, not when its python runs directly (`make run`, `.venv/bin/wafer`). Without
    this, a machine with no system ninja silently ran the slower torch paths."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    if ninja.BIN_DIR and shutil.which("ninja", path=ninja.BIN_DIR):  # "": it found no binary
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _not_built(reason: object) -> bool:
    log.warning("C++ CPU kernels not built (%s): the torch paths run instead", reason)
    return False


def _is_built(directory: Path, name: str) -> bool:
    """Whether a finished build of `name` is in `directory` (loading it takes no time to show)."""
    return any(directory.glob(f"{name}*.so"))


def _build(show_progress: bool) -> bool:
    try:
        from torch.utils import cpp_extension  # imports setuptools, which a venv may lack
    except ImportError as exc:
        return _not_built(exc)
    ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return _not_built("ninja is not installed")
    # The name carries the sources' hash: an edited kernel never loads a stale build.
    name = f"wafer_cpu_{source_digest()}"
    what = "building the C++ CPU kernels (once; cached for the next start)"
    try:
        directory = build_directory(name)
        with _one_builder(directory), ticking(what, enabled=show_progress and not _is_built(directory, name)):
            module = cpp_extension.load(
                name,
                [str(s) for s in staged_sources(directory)],
                extra_cflags=FLAGS,
                extra_ldflags=LDFLAGS,
                build_directory=str(directory),
                is_python_module=True,
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError) as exc:  # no compiler, a failed build or load
        lines = str(exc).splitlines() or [type(exc).__name__]
        reason = next((line for line in lines if "error" in line), lines[0])
        return _not_built(reason.strip())
    _module.append(module)
    torch.library.register_fake("wafer::w8a8_linear")(_fake_linear)
    torch.library.register_fake("wafer::w8a8_linear_packed")(_fake_linear_packed)
    torch.library.register_fake("wafer::decode_attention")(_fake_attention)
    torch.library.register_fake("wafer::argmax_rows")(_fake_argmax)
    torch.library.register_fake("wafer::f32_linear_t")(_fake_f32_linear)
    return True


def _ops() -> object:
    """The kernels' op namespace, loading them first; a clear error where they cannot be built."""
    if not load(show_progress=False):
        raise RuntimeError("the C++ CPU kernels are not built here (the log says why)")
    return torch.ops.wafer


def cpu_isas() -> list[str]:
    """The instruction-set levels this CPU supports (of ISAS), lowest first."""
    return list(_ops().cpu_isas())  # type: ignore[attr-defined]


def variants() -> dict[str, str]:
    """Which variant each kernel runs now (the best the CPU has, under the cap)."""
    ops = _ops()
    return {name: str(getattr(ops, f"{name}_variant")()) for name in KERNELS}


def set_isa_cap(name: str) -> str:
    """Cap every kernel at the level `name` (of ISAS) for this process; returns the previous cap.
    A cap above what the CPU has changes nothing; an unknown name raises ValueError."""
    if name not in ISAS:
        raise ValueError(f"unknown instruction-set level {name!r}: one of {', '.join(ISAS)}")
    return str(_ops().set_isa_cap(name))  # type: ignore[attr-defined]


@contextlib.contextmanager
def limit_isa(name: str) -> Iterator[dict[str, str]]:
    """Within the block, the kernels run at most the level `name`; yields `variants()` there."""
    before = set_isa_cap(name)
    try:
        yield variants()
    finally:
        set_isa_cap(before)


def describe() -> str:
    """One line for logs and driver info: the kernels' variants, or why the torch paths run."""
    if "loaded" not in _state:
        return "C++ CPU kernels not loaded (not used by this configuration)"
    if not _state["loaded"]:
        return "C++ CPU kernels not built: torch paths"
    chosen = variants()
    line = ", ".join(f"{k} {v}" for k, v in chosen.items())
    if all(v == "portable" for v in chosen.values()):
        line += " (no vector variant for this CPU: correct, not fast)"
    return f"{line}; CPU supports {' '.join(cpu_isas())}"


def pass_planner() -> ModuleType | None:
    """`pass_plan.cpp`'s functions once `load()` built them (this never builds), else None."""
    return _module[0] if _module else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.max(-1).indices` of a 2-D tensor (the first maximum; the first NaN of a row that has
    one): the C++ op for float32 CPU rows once `load()` registered it (this never builds)."""
    if _state.get("loaded") and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[1] > 0:
        out: torch.Tensor = torch.ops.wafer.argmax_rows(x)
        return out
    return x.max(-1).indices


def sample_rows(
    logits: torch.Tensor,
    rows: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    u: np.ndarray,
) -> torch.Tensor | None:
    """The sampled token of each of `logits`' `rows` (int64), with each row's temperature, top-k,
    top-p, min-p and uniform draw `u`, as `sampling.py`'s torch path picks it (to float32 rounding
    of the softmax): the C++ op for float32 CPU logits once `load()` registered it (this never
    builds); None where it does not run (the caller keeps the torch path). An array is copied only
    where its dtype differs or it is read-only (decoded from a bridge frame: torch.from_numpy
    refuses those)."""
    if not (_state.get("loaded") and logits.device.type == "cpu" and logits.dtype == torch.float32):
        return None

    def tensor(a: np.ndarray, dtype: type) -> torch.Tensor:
        return torch.from_numpy(np.require(a, dtype, ["C", "W"]))

    out: torch.Tensor = torch.ops.wafer.sample_rows(
        logits,
        tensor(rows, np.int64),
        tensor(temperature, np.float32),
        tensor(top_k, np.int64),
        tensor(top_p, np.float32),
        tensor(min_p, np.float32),
        tensor(u, np.float64),
    )
    return out
