"""The optional compiled path (`--compile`, CPU): each decoder layer, attention over the paged
cache included, runs as one `torch.compile`d (Inductor: C++) function, shared by all layers (they
take their block as an argument). A decode pass (one query per request: batch 1 or a batch of
contexts) runs the whole model, embedding and output head included, as one graph instead: each
compiled call costs ~70-100 us in dynamo's guards and Inductor's Python wrapper, a third of a
batch-1 step, and 30 of them ~5% of a batch-32 step. Passes with LoRA adapters stay eager; the
driver refuses it on CUDA, whose attention is a Triton kernel. On a tensor-parallel shard the model's `reduce`
(an all-reduce) is traced into the graphs: dynamo turns `dist.all_reduce` into a functional
collective that Inductor calls in place, so a layer stays one graph.

Graphs: the stack's for one token and for one token per request (batch sizes are symbolic from
2 on); the per-layer function's for everything else (prefill, mixed passes).
`PagedAttention(for_compiled=True)` pads the layouts so that no other size pattern occurs
(dynamo specializes sizes 0 and 1), far under dynamo's recompile limit (8); the handshake
compiles all three. Once compiled, graphs are called after a check of dynamo's guards, without
dynamo's frame machinery (`direct_graphs.py`)."""

from __future__ import annotations

import torch

from drivers.torch.config import ModelConfig
from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.paged_attention import LayerKeys, PagedAttention, attend_keys
from drivers.torch.model import (
    Block,
    Reduce,
    Transformer,
    attention_inputs,
    attention_output,
    layer_rope,
    output_logits,
)
from drivers.torch.runners.direct_graphs import DirectGraphs

_Families = dict[int, tuple[torch.Tensor, ...]]  # `PagedAttention.family_keys` by window


def unsupported(cfg: ModelConfig) -> str:
    """Why the compiled graphs cannot run this model ("" if they can): the attention they call
    has no logit soft cap, and layers without RoPE would give the per-layer function a second
    graph for each size pattern that is not marked dynamic; a mixture of experts sizes its matmuls
    by how many tokens each expert got (counts read back from the tensors, not marked dynamic)."""
    if cfg.num_experts:
        return "mixture-of-experts blocks"
    if cfg.attn_logit_softcap:
        return "an attention logit soft cap"
    if cfg.layers_without_rope:
        return "layers without RoPE"
    return ""


def _layer(
    cfg: ModelConfig,
    block: Block,
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    keys: LayerKeys,
    kernel: bool,
    reduce: Reduce | None,
) -> torch.Tensor:
    q, k, v = attention_inputs(cfg, block, x, cos, sin, None)
    return attention_output(cfg, block, x, attend_keys(q, k, v, keys, cfg.scale, True, kernel), None, reduce)


def _stack(
    cfg: ModelConfig,
    model: Transformer,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    caches: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]],
    families: _Families,
    kernel: bool,
    reduce: Reduce | None,
) -> torch.Tensor:
    """A decode pass's logits from its tokens and positions: the embedding and RoPE, every layer
    and the output head in one graph. `caches`: each layer's K and V pages; `families`:
    `PagedAttention.family_keys` by window. The layers' keys are put together here, so that the
    graph's inputs hold each tensor once."""
    x, (cos, sin), (cos_local, sin_local) = model.embed(tokens, positions)
    for i, block in enumerate(model.model.blocks()):
        cos_i, sin_i = layer_rope(cfg, i, (cos, sin), (cos_local, sin_local))
        keys = LayerKeys(caches[0][i], caches[1][i], *families[cfg.window(i)])
        x = _layer(cfg, block, x, cos_i, sin_i, keys, kernel, reduce)
    return output_logits(cfg, model.model.norm, model.head(), x)


def _mark_dynamic(*tensors: torch.Tensor) -> None:
    """Compile these tensors' sizes as symbols (sizes 0 and 1 stay specialized)."""
    for t in tensors:
        for dim in range(t.dim()):
            torch._dynamo.maybe_mark_dynamic(t, dim)


def _mark_stack(
    cfg: ModelConfig,
    model: Transformer,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    caches: object,
    families: _Families,
    *rest: object,
) -> None:
    """Before dynamo sees a stack call (only it reads the marks; a direct call passes unmarked
    tensors, which the guards accept): the pass's sizes are symbols, size 1 stays specialized."""
    _mark_dynamic(*{id(t): t for f in families.values() for t in f}.values())  # families share some
    _mark_dynamic(tokens, positions)


class CompiledModel:
    """Check `unsupported(model.cfg)` first."""

    def __init__(self, model: Transformer) -> None:
        assert not unsupported(model.cfg), unsupported(model.cfg)
        self.model = model
        # Each model compiles its own copies (dynamo counts graphs per code object), called
        # without dynamo's per-call overhead once compiled (`direct_graphs.py`).
        # The graphs call the C++ ops: a rebuilt op must not meet graphs cached for the old one.
        # The model's modules are frozen: their weights and attributes are never changed once it
        # is compiled (their guards are dropped, their tensors read once; see direct_graphs.py).
        # So are the globals the traced code reads: the driver never rebinds its functions or ops.
        key = cpu_kernels.source_digest()
        self._layer = DirectGraphs(_layer, key, frozen=("cfg",), frozen_globals=True)
        self._logits = DirectGraphs(output_logits, key, frozen=("cfg", "norm", "head"), frozen_globals=True)
        # The stack's K/V pages are frozen too: one cache's per-layer views, the same tensors at every
        # pass (their contents change, never their sizes); a new cache gets a new CompiledModel.
        self._stack = DirectGraphs(
            _stack, key, frozen=("cfg", "model", "caches"), before_dynamo=_mark_stack, frozen_globals=True
        )
        self._blocks = model.model.blocks()
        cfg = model.cfg
        self._windows = sorted({cfg.window(i) for i in range(cfg.num_layers)})

    def decode_stack(self, tokens: torch.Tensor, positions: torch.Tensor, attention: PagedAttention) -> torch.Tensor:
        """Logits of every row of a decode pass (one token per request)."""
        model = self.model
        families = {w: attention.family_keys(w) for w in self._windows}
        cache = attention.cache
        caches = (cache.k_layers, cache.v_layers)
        return self._stack(model.cfg, model, tokens, positions, caches, families, attention.kernel, model.reduce)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, attention: PagedAttention, rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits of `rows`, as `Transformer.forward` without LoRA."""
        assert attention.for_compiled, "a compiled pass needs padded attention layouts"
        model, cfg = self.model, self.model.cfg
        # One query per request (decode): the stack, logits of every row, then `rows` of them.
        if attention.plan.q_index.shape[1] == 1:
            logits = self.decode_stack(tokens, positions, attention)
            # Decode asks for every row in order, most of the time: then no copy (6 MB at batch 32).
            every_row = rows.shape[0] == logits.shape[0] and torch.equal(rows, torch.arange(rows.shape[0]))
            return logits if every_row else logits[rows]
        x, rope_full, rope_local = model.embed(tokens, positions)
        for i, block in enumerate(self._blocks):
            cos, sin = layer_rope(cfg, i, rope_full, rope_local)
            keys = attention.layer_keys(i)
            if i == 0:  # only the first call of a pass can compile
                _mark_dynamic(x, cos, sin, keys.slots, keys.q_index, keys.key_index, keys.mask, keys.empty, keys.valid)
            x = self._layer(cfg, block, x, cos, sin, keys, attention.kernel, model.reduce)
        # At least 2 rows (repeating row 0), so that passes with 0 or 1 output rows (a prompt's
        # prefill) reuse the graph of 2 and more rather than compile their own.
        n = rows.shape[0]
        if n < 2:
            rows = torch.cat((rows, rows.new_zeros(2 - n)))
        x = x[rows]
        _mark_dynamic(x)
        return self._logits(cfg, model.model.norm, model.head(), x)[:n]
