"""Activation smoothing before w8a8 quantization (SmoothQuant): a transform of the float model
that leaves its outputs unchanged and moves the outlier channels of each matmul's input into the
weights. w8a8 quantizes each input row with one scale, so a row whose largest channel is ~25x the
others (SmolLM2's normalized activations) keeps little of its small values. For each projection
input channel j, with X_j its largest magnitude over a calibration pass and W_j the largest weight
of that input column:

    s_j = X_j ** alpha / W_j ** (1 - alpha)        x'_j = x_j / s_j        W'[:, j] = W[:, j] * s_j

and x / s is folded into what produces x: the RMS norm's weight before q/k/v and gate/up, the value
projection's rows before the output projection (one s per KV head channel, shared by the query
heads of its group), the up projection's rows before the down projection. The output head keeps
its weights (tied to the embedding). Measured on SmolLM2 (3 prompts, w8a8 logits against float32):
correlation 0.979-0.990 without, 0.993-0.995 with alpha 0.5 (0.4, 0.65, 0.8 did worse).

On a tensor-parallel shard (`model.reduce` set, every rank calling `smooth` together) each fold
stays within the rank: v rows and o columns are the same heads' channels, up rows and down columns
the same MLP columns. The input channels of q/k/v and gate/up are whole on every rank, and
`max_over_ranks` makes their factors those of the whole model, so the replicated norms stay equal."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from drivers.torch.config import ModelConfig
from drivers.torch.model import Attend, RMSNorm, Transformer

# The elementwise maximum of a tensor over tensor-parallel ranks (`RankGroup.max`).
MaxOverRanks = Callable[[torch.Tensor], torch.Tensor]

ALPHA = 0.5
# Text of several kinds (prose, facts, code, a chat turn), tokenized by the model's tokenizer.
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers "
    "that changed physics. Paris is the capital of France, and Berlin is the capital of Germany. "
    "def add(a, b):\n    return a + b\n<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n"
    "<|im_start|>assistant\n12 times 7 is 84."
)
_EPS = 1e-5


def cannot_smooth(cfg: ModelConfig) -> str:
    """Why `smooth` cannot fold this model's factors ("" if it can): the q/k/v and gate/up inputs
    must come out of a norm, and each MLP input feed one gate/up (not a router and experts)."""
    if cfg.num_experts:
        return "mixture-of-experts blocks"
    return "" if cfg.has_pre_norms else "blocks without norms before attention and MLP"


def smooth(
    model: Transformer, calibration: list[int], alpha: float = ALPHA, max_over_ranks: MaxOverRanks | None = None
) -> Transformer:
    """Smooth the projections of a fused float model (see `fusion.py`) in place, from one causal
    pass over the `calibration` tokens. Every changed weight is a new tensor: the checkpoint's
    tensors, which other models may share, are never written. On a tensor-parallel shard, every
    rank calls this with the same tokens and `max_over_ranks` (see the module's docstring)."""
    stats = _input_maxima(model, calibration)
    whole = max_over_ranks or (lambda t: t)
    cfg = model.cfg
    group, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    v_start = (cfg.num_heads + cfg.num_kv_heads) * d
    for i, block in enumerate(model.model.blocks()):
        attn, mlp = block.self_attn, block.mlp
        assert attn.qkv is not None and mlp.gate_up is not None, "smooth the fused model"
        mlp_norm = block.pre_feedforward_layernorm if cfg.arch == "gemma" else block.post_attention_layernorm
        for lin, norm, key in ((attn.qkv, block.input_layernorm, "qkv"), (mlp.gate_up, mlp_norm, "gate_up")):
            # Over ranks: each holds some of the rows; the inputs are whole (equal to rounding).
            s = _factor(whole(stats[i, key]), whole(_column_max(lin)), alpha)
            _scale_columns(lin, s)
            _divide_norm(norm, s)
        # down_proj's input is act(gate) * up: divide up's rows. A rank holds whole columns of
        # down and o, so their factors need nothing from the other ranks.
        s = _factor(stats[i, "down_proj"], _column_max(mlp.down_proj), alpha)
        _scale_columns(mlp.down_proj, s)
        _divide_rows(mlp.gate_up, cfg.intermediate_size, s)
        # o_proj's input channel (head h, dim) comes from value channel (h // group, dim).
        x_max = stats[i, "o_proj"].view(cfg.num_kv_heads, group, d).amax(1)
        w_max = _column_max(attn.o_proj).view(cfg.num_kv_heads, group, d).amax(1)
        s = _factor(x_max, w_max, alpha)  # [Hkv, D]
        _scale_columns(attn.o_proj, s[:, None, :].expand(-1, group, -1).reshape(-1))
        _divide_rows(attn.qkv, v_start, s.reshape(-1))
    return model


def calibration_tokens(tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """The calibration pass's tokens: `CALIBRATION_TEXT` through the model's tokenizer, else
    fixed ids."""
    if tokenizer is not None:
        return [t % vocab_size for t in tokenizer.encode(CALIBRATION_TEXT).ids]
    return [(i * 7919) % vocab_size for i in range(96)]


def causal_attention(scale: float) -> Attend:
    """Attention of one sequence over itself, causal, without a cache (every key in reach:
    windows do not matter for channel maxima)."""

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)

    return attend


def _input_maxima(model: Transformer, tokens: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """The largest magnitude of each input channel of every projection over one causal pass."""
    stats: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.model.blocks()):
        attn, mlp = block.self_attn, block.mlp
        for key, lin in (
            ("qkv", attn.qkv),
            ("o_proj", attn.o_proj),
            ("gate_up", mlp.gate_up),
            ("down_proj", mlp.down_proj),
        ):
            assert lin is not None

            def record(mod: nn.Module, args: tuple[torch.Tensor, ...], key: tuple[int, str] = (i, key)) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0).float()
                stats[key] = torch.maximum(stats[key], x) if key in stats else x

            hooks.append(lin.register_forward_pre_hook(record))
    device = model.model.embed_tokens.weight.device
    ids = torch.tensor(tokens, device=device)
    try:
        with torch.inference_mode():
            model(ids, torch.arange(len(tokens), device=device), causal_attention(model.cfg.scale), ids.new_zeros(1))
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def _factor(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    return (x_max.clamp(min=_EPS) ** alpha / w_max.float().clamp(min=_EPS) ** (1 - alpha)).clamp(min=_EPS)


def _column_max(lin: nn.Module) -> torch.Tensor:
    assert isinstance(lin, nn.Linear), "smooth before quantizing"
    return lin.weight.detach().abs().amax(0)


def _scale_columns(lin: nn.Module, s: torch.Tensor) -> None:
    assert isinstance(lin, nn.Linear)
    lin.weight = nn.Parameter((lin.weight.detach().float() * s[None, :]).to(lin.weight.dtype), requires_grad=False)


def _divide_rows(lin: nn.Module, start: int, s: torch.Tensor) -> None:
    """Divide output rows start .. start + len(s) (and their biases) by s."""
    assert isinstance(lin, nn.Linear)
    end = start + s.numel()
    weight = lin.weight.detach().float().clone()
    weight[start:end] /= s[:, None]
    lin.weight = nn.Parameter(weight.to(lin.weight.dtype), requires_grad=False)
    if lin.bias is not None:
        bias = lin.bias.detach().float().clone()
        bias[start:end] /= s
        lin.bias = nn.Parameter(bias.to(lin.bias.dtype), requires_grad=False)


def _divide_norm(norm: RMSNorm, s: torch.Tensor) -> None:
    """The norm's output / s: Llama's weight w / s; Gemma's multiplier (offset + w) / s."""
    w = norm.weight.detach().float()
    norm.weight = nn.Parameter(((norm.offset + w) / s - norm.offset).to(norm.weight.dtype), requires_grad=False)
