"""Torch-driver test setup: one torch thread (two collapse on a shared 2-core machine), Triton's
interpreter for kernel tests (read when kernels are decorated, so set before any import of them),
and SmolLM2 loaded once per session."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from drivers.torch.checkpoint import Checkpoint, load_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    return load_checkpoint("smollm2", show_progress=False)
