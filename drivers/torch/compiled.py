"""The optional compiled path (`--compile`, CPU): each decoder layer, attention over the paged
cache included, runs as one `torch.compile`d (Inductor: C++) function, shared by all layers (they
take their block as an argument). Passes with LoRA adapters stay eager; the driver refuses it on
CUDA, whose attention is a Triton kernel.

Graphs, per function: one token (decode at batch 1); one token per request (decode batches,
where attention runs as fused reductions); everything else. `PagedAttention(for_compiled=True)`
pads the layouts so that no other size pattern occurs (dynamo specializes sizes 0 and 1), far
under dynamo's recompile limit (8); the handshake compiles all three."""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from drivers.torch.config import ModelConfig
from drivers.torch.model import Block, Transformer, attention_inputs, attention_output, output_logits
from drivers.torch.paged_attention import LayerKeys, PagedAttention, attend_keys


def _layer(
    cfg: ModelConfig, block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: LayerKeys
) -> torch.Tensor:
    q, k, v = attention_inputs(cfg, block, x, cos, sin, None)
    return attention_output(cfg, block, x, attend_keys(q, k, v, keys, cfg.scale, fused_decode=True), None)


def _own_copy(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` with its own code object. Dynamo keeps graphs per code object and counts them against
    its recompile limit (8) there: without copies, a process compiling models of three dtypes or
    weight kinds (three graphs each; the bench does) fails on the third."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _mark_dynamic(*tensors: torch.Tensor) -> None:
    """Compile these tensors' sizes as symbols (sizes 0 and 1 stay specialized)."""
    for t in tensors:
        for dim in range(t.dim()):
            torch._dynamo.maybe_mark_dynamic(t, dim)


class CompiledModel:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        self._layer: Callable[..., torch.Tensor] = torch.compile(_own_copy(_layer), fullgraph=True)
        self._logits: Callable[..., torch.Tensor] = torch.compile(_own_copy(output_logits), fullgraph=True)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, attention: PagedAttention, rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits of `rows`, as `Transformer.forward` without LoRA."""
        assert attention.for_compiled, "a compiled pass needs padded attention layouts"
        model, cfg = self.model, self.model.cfg
        x, rope_full, rope_local = model.embed(tokens, positions)
        for i, block in enumerate(model.model.blocks()):
            cos, sin = rope_local if cfg.window(i) > 0 else rope_full
            keys = attention.layer_keys(i)
            if i == 0:  # only the first call of a pass can compile
                _mark_dynamic(x, cos, sin, keys.slots, keys.q_index, keys.key_index, keys.mask, keys.empty, keys.valid)
            x = self._layer(cfg, block, x, cos, sin, keys)
        x = x[rows]
        _mark_dynamic(x)
        return self._logits(cfg, model.model.norm, model.head(), x)
