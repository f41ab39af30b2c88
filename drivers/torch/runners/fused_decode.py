"""The fused decode step: a decode pass (one token per request) of a Llama-style model with w8a8
or dense float32 weights on the CPU as one C++ call, `DecodeStep` of `decode_step.cpp`, from the embeddings to the
output rows' logits, on the threads of one parallel region. The same kernels as the ops the model
calls otherwise (eager or compiled), without ~150 op calls a step between which one thread runs the
small work (norms, RoPE, SiLU, residuals) while the other waits.

It runs where `unsupported()` finds nothing against it (the model and cache the driver has) and
for passes `takes()` accepts (decode, no LoRA adapter); everything else keeps the model's own path.
Logits agree with that path to float32 rounding (amplified by w8a8's rounding of activations to
int8 codes: tests compare greedy tokens and logits within a tolerance), and a row's logits do not
depend on the other rows of its pass or on the thread count (tested bit for bit)."""

from __future__ import annotations

import torch
from torch import nn

from drivers.torch.batch_plan import PassPlan
from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.paged_attention import PagedAttention
from drivers.torch.kv_cache import PagedKVCache
from drivers.torch.model import Transformer
from drivers.torch.rope import model_attention_factors
from drivers.torch.weights.cpu_layout import TransposedLinear
from drivers.torch.weights.quantize import DynamicInt8Linear

# The most tokens a w8a8 pass takes: as many as were measured. From 4 rows on the step shares the
# rows' own work (norms, int8 rounding, SiLU, residuals) out between its threads (before, every
# thread did all of it, work that grows with the rows while the weights read do not, and batch 32
# gained only 1.05x). bench/decode.py --interleave (SmolLM2, a float16 KV cache, 2 threads, Zen 4),
# against the compiled model, two runs of 3 rounds (medians): batch 4 1.18-1.30x, 8 1.27-1.40x,
# 16 1.23-1.29x, 32 1.21-1.23x, 48 1.22x, 64-128 1.07-1.24x. Dense float32 passes take as many as
# its product does (`f32_matvec.cpp`'s kMaxRows, 24). Under the AVX2 cap 1.07-1.12x at 8-128 rows.
# The portable variant stops below the rows from which the model's path runs torch's float32
# matmul instead of the integer kernel (`quantize.choose_matmuls`): with the kernels capped at it
# here, 128 rows decoded 83 tok/s fused against 190 that way (8-32 rows: the same kernel, equal).
W8A8_MAX_ROWS = 128


def w8a8_max_rows(linears: list[DynamicInt8Linear]) -> int:
    """The most tokens a w8a8 pass over `linears` takes in the kernels' variant now."""
    if cpu_kernels.variants()["w8a8"] != "portable":
        return W8A8_MAX_ROWS
    return min([W8A8_MAX_ROWS, *(lin.sgemm_from_rows - 1 for lin in linears if lin.sgemm_from_rows > 0)])


def _packed(lin: object) -> bool:
    return isinstance(lin, DynamicInt8Linear) and lin.use_kernel and lin.packed is not None and lin.bias is None


def _transposed(lin: object) -> bool:
    return isinstance(lin, TransposedLinear) and lin.use_kernel and lin.bias is None


def _weights(lin: object) -> torch.Tensor:
    """What `DecodeStep` reads of a projection: the packed w8a8 bytes or the float32 [in, out]."""
    if isinstance(lin, DynamicInt8Linear):
        assert lin.packed is not None
        return lin.packed
    assert isinstance(lin, TransposedLinear)
    return lin.weight_t


def unsupported(model: Transformer, cache: PagedKVCache) -> str:
    """Why the fused step cannot run this model and cache ("" if it can)."""
    cfg = model.cfg
    reasons = [
        (cfg.arch != "llama", f"{cfg.arch} blocks"),
        (cfg.num_experts > 0, "mixture-of-experts blocks"),
        (bool(cfg.qk_norm) or cfg.final_logit_softcap > 0, "q/k norms or a logit soft cap"),
        (not cfg.has_pre_norms, "blocks with norms after attention and MLP"),
        (bool(cfg.layers_without_rope) or cfg.rope_dim != cfg.head_dim, "layers without RoPE or partial RoPE"),
        (model_attention_factors(cfg)[0] != 1.0, "a RoPE attention factor (YaRN, LongRoPE)"),
        (
            (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) != (1.0, 1.0, 1.0),
            "embedding, residual or logit multipliers",
        ),
        (any(cfg.window(i) for i in range(cfg.num_layers)), "windowed attention layers"),
        (model.reduce is not None, "a tensor-parallel shard"),
        (cache.k.device.type != "cpu", "a cache off the CPU"),
        (model.model.embed_tokens.weight.dtype != torch.float32, "activations other than float32"),
        (cpu_kernels.pass_planner() is None, "the C++ kernels not built"),
    ]
    for bad, why in reasons:
        if bad:
            return why
    head = model.output_head
    kind = _packed if _packed(head) else _transposed if _transposed(head) else None
    if kind is None:
        return "an output head other than a packed w8a8 or a float32 kernel one"
    for block in model.model.blocks():
        attn, mlp = block.self_attn, block.mlp
        if not all(kind(lin) for lin in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)):
            return "projections other than fused ones of the output head's kind (packed w8a8 or float32 kernel)"
    return ""


class FusedDecode:
    """`DecodeStep` over `model`'s weights and `cache`'s pages (both kept for its lifetime: a new
    cache needs a new one). Check `unsupported(model, cache)` first."""

    def __init__(self, model: Transformer, cache: PagedKVCache) -> None:
        reason = unsupported(model, cache)
        assert not reason, reason
        module = cpu_kernels.pass_planner()
        assert module is not None
        cfg = model.cfg
        linears: list[nn.Module] = []
        norms: list[torch.Tensor] = []
        for block in model.model.blocks():
            attn, mlp = block.self_attn, block.mlp
            linears += [attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj]  # type: ignore[list-item]
            norms += [block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach()]
        assert model.output_head is not None
        linears.append(model.output_head)
        norms.append(model.model.norm.weight.detach())
        self.model = model
        self.cache = cache
        self._step = module.DecodeStep(
            model.model.embed_tokens.weight.detach().contiguous(),
            model.inv_freq.float().contiguous(),
            [_weights(lin) for lin in linears],
            [_weights(lin).shape[1] if _transposed(lin) else lin.out_features for lin in linears],
            [w.contiguous() for w in norms],
            cache.k,
            cache.v,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_eps,
            cfg.scale,
        )
        self.passes = 0  # passes run (for tests and `health`)
        packed = [lin for lin in linears if isinstance(lin, DynamicInt8Linear)]
        self.max_rows = w8a8_max_rows(packed) if packed else int(self._step.max_rows())

    def variant(self) -> str:
        """The kernels' variants a step runs now, e.g. "w8a8 avx512_vnni, attention avx512"."""
        return str(self._step.variant())

    def set_split_rows(self, rows: int) -> None:
        """From how many rows on the threads share out the rows' own work (norms, int8 rounding,
        SiLU, residuals; 4 by default; below it every thread does every row's): for tests and
        benches, the same bits either way."""
        self._step.set_split_rows(rows)

    def takes(self, plan: PassPlan) -> bool:
        """Whether `plan` is a decode pass (one token for each request) of at most `max_rows` tokens."""
        return plan.q_index.shape[1] == 1 and len(plan.tokens) == plan.q_index.shape[0] <= self.max_rows

    def __call__(self, plan: PassPlan, attention: PagedAttention, rows: torch.Tensor) -> torch.Tensor:
        """Float32 logits [len(rows), vocab] of a decode pass (`takes(plan)`), its K/V written."""
        slots, _, key_index, mask, empty, _ = attention.family_keys(0)
        args = (plan.tokens, plan.positions, slots, key_index, mask[:, 0], empty[:, 0], rows)
        logits: torch.Tensor = self._step.step(*args)
        self.passes += 1
        return logits
