"""Torch-driver test setup: one torch thread (two collapse on a shared 2-core machine), Triton's
interpreter for kernel tests (read when kernels are decorated, so set before any import of them),
SmolLM2 loaded once per session, and the C++ kernels' fixtures: `kernel` (built) and `isa` (each
instruction-set level in turn)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import pytest
import torch

from drivers.torch.kernels import cpu_kernels
from drivers.torch.weights.checkpoint import Checkpoint, load_checkpoint
from tests.drivers.torch.helpers import FEATURES

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    return load_checkpoint("smollm2", show_progress=False)


@pytest.fixture(scope="module")
def kernel() -> None:
    assert cpu_kernels.load(show_progress=False), "the kernel did not build (see the logged reason)"


@pytest.fixture(params=cpu_kernels.ISAS)
def isa(request: pytest.FixtureRequest, kernel: None) -> Iterator[dict[str, str]]:
    """Each instruction-set level in turn, the kernels capped there; yields their variants."""
    name = request.param
    if name not in cpu_kernels.cpu_isas():
        pytest.skip(f"this CPU lacks {FEATURES[name]}: the {name} variants cannot run here")
    with cpu_kernels.limit_isa(name) as chosen:
        yield chosen
