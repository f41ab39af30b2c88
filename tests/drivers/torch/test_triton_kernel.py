"""The Triton paged-attention kernel matches the plain-torch reference, run through Triton's
interpreter (TRITON_INTERPRET=1, set in conftest before the kernel module is imported) in fp32 and
fp16: page sizes 1, 16, 32; full, windowed and windowed-with-sinks layers; custom masks; GQA;
prefill, continuation chunks and decodes in one batch."""

from __future__ import annotations

import os

import pytest
import torch

from bridge_schema.batch import OutputSpec
from drivers.torch.batch_plan import CacheLimits, build_plan, family_keys
from drivers.torch.kernels.attention_ref import masked_attention
from tests.drivers.torch.helpers import brle, forward, random_tokens, request

pytest.importorskip("triton")
# The conftest turns the interpreter on unless TRITON_INTERPRET is set; with TRITON_INTERPRET=0 on a
# machine with a GPU the same tests run the compiled kernel.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
# The interpreter computes bf16 wrongly; compiled on a GPU, bf16 is tested too.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])

from drivers.torch.kernels.attention_triton import paged_attention  # noqa: E402

H, HKV, D = 4, 2, 16
NUM_PAGES_TOKENS = 160


def _plan(page_size: int, with_mask: bool):  # type: ignore[no-untyped-def]
    num_pages = NUM_PAGES_TOKENS // page_size
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(page_size)).tolist()
    per_req = num_pages // 3
    shapes = [(0, 20), (36, 1), (22, 8)]  # (tokens already cached, new tokens): prefill, decode, chunk
    specs = []
    for r, (start, n) in enumerate(shapes):
        kv = start + n
        rows = None
        if with_mask and r != 1:
            rows = [brle([(j * 7 + i) % 5 != 0 or j == start + i for j in range(kv)]) for i in range(n)]
        pages = perm[r * per_req : (r + 1) * per_req]
        specs.append(
            request(random_tokens(n, 10, r), start, pages, page_size, outputs=[OutputSpec(row=n - 1)], mask_rows=rows)
        )
    limits = CacheLimits(page_size, num_pages, 10, NUM_PAGES_TOKENS, 20)
    return build_plan(forward(specs), limits, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16, 32])
@pytest.mark.parametrize(("window", "sinks"), [(0, 0), (4, 0), (8, 2)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_kernel_matches_reference(dtype: torch.dtype, page_size: int, window: int, sinks: int, with_mask: bool) -> None:
    g = torch.Generator().manual_seed(0)
    plan = _plan(page_size, with_mask)
    k_cache = torch.randn(NUM_PAGES_TOKENS, HKV, D, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(NUM_PAGES_TOKENS, HKV, D, generator=g).to(DEVICE, dtype)
    q = torch.randn(plan.tokens.shape[0], H, D, generator=g).to(DEVICE, dtype)
    scale = D**-0.5
    fam = family_keys(plan, window, sinks, page_size)
    kf, vf = k_cache.float()[fam.key_index], v_cache.float()[fam.key_index]
    ref = masked_attention(q.float()[plan.q_index], kf, vf, fam.mask, scale)[plan.q_valid]
    out = paged_attention(q, k_cache, v_cache, plan, page_size, scale, window, sinks)
    # Compiled on a GPU, fp32 dots run in tf32.
    tol = {torch.float32: 1e-4 if INTERPRETED else 5e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
