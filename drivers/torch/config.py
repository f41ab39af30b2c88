"""The model configuration the torch driver runs: one typed object built by a loader, validated
once, passed down. It knows the model's shape, not where the weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivers.errors import ConfigRejected
from drivers.torch.rope import RopeScaling

ARCHITECTURES = ("llama", "gemma")
QK_NORMS = ("", "head", "projection")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    `arch` "llama" is the pre-norm SiLU block (Llama 2/3, Mistral, Qwen2/3, OLMo 2, Granite,
    SmolLM3, Phi-3); "gemma" is the Gemma-2/3 style block: (1 + w) RMS norms, sandwich norms,
    GELU-tanh MLP, scaled embeddings. The switches below are the families' differences on these
    two blocks; `drivers/torch/families/` maps each family's config onto them.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # RoPE rotates the first `rotary_dim` dims of each head (0 = all; Phi-4-mini: 3/4), the rest pass.
    rotary_dim: int = 0
    # RoPE scaling of full-attention layers (None = default): linear, dynamic NTK, YaRN, LongRoPE
    # or Llama 3.1+'s, with its parameters; `rope.py` computes its frequencies and attention factor.
    rope_scaling: RopeScaling | None = None
    rms_eps: float = 1e-5
    max_position: int = 8192
    tie_embeddings: bool = True
    attention_bias: bool = False
    # Per layer: 0 = full attention, w > 0 = the query sees keys with slot > own slot - w.
    layer_windows: tuple[int, ...] = ()
    # Windowed layers also always see the first `num_sink_tokens` slots (attention sinks).
    num_sink_tokens: int = 0
    # Gemma-style extras.
    rope_local_theta: float = 0.0  # RoPE base of windowed layers (0 = rope_theta)
    query_scale: float = 0.0  # softmax scale (0 = head_dim ** -0.5)
    # RMS norms of q and k before RoPE: "" none, "head" over each head (Gemma 3, Qwen3),
    # "projection" over the whole q and k projections (OLMo 2).
    qk_norm: str = ""
    final_logit_softcap: float = 0.0
    attn_logit_softcap: float = 0.0  # Gemma 2: scores = cap * tanh(scores / cap) before the softmax
    # False (OLMo 2): no norms before attention and MLP; their outputs are normed before the residual add.
    has_pre_norms: bool = True
    # OLMo 2's RMS norm multiplies by its weight in float32, then casts back (Llama's casts first).
    norm_weight_in_float32: bool = False
    # Granite: embeddings times `embedding_multiplier`, each block's attention and MLP outputs times
    # `residual_multiplier` before their residual adds, logits divided by `logits_scaling`.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # SmolLM3: layers whose q and k get no RoPE.
    layers_without_rope: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen3-MoE; 0 experts = dense): each MoE layer holds `num_experts`
    # SiLU MLPs of `moe_intermediate_size`; each token runs its top `experts_per_token` by the
    # router's softmax, weighted by their probabilities, renormalized to sum 1 where
    # `norm_topk_prob`. `dense_mlp_layers` keep one dense MLP of `intermediate_size` instead
    # (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    moe_intermediate_size: int = 0
    dense_mlp_layers: tuple[int, ...] = ()
    name: str = "model"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigRejected(f"architecture {self.arch!r} is not one of {ARCHITECTURES}", "arch")
        if self.num_heads % self.num_kv_heads:
            raise ConfigRejected("num_heads must be a multiple of num_kv_heads", "num_kv_heads")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigRejected("layer_windows needs one entry per layer", "layer_windows")
        if any(w < 0 for w in self.layer_windows):
            raise ConfigRejected("a layer window is negative", "layer_windows")
        if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
            raise ConfigRejected("rotary_dim must be even and at most head_dim", "rotary_dim")
        if self.qk_norm not in QK_NORMS:
            raise ConfigRejected(f"qk_norm {self.qk_norm!r} is not one of {QK_NORMS}", "qk_norm")
        if any(not 0 <= i < self.num_layers for i in self.layers_without_rope):
            raise ConfigRejected("a layer without RoPE is not a layer of the model", "layers_without_rope")
        if min(self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) <= 0:
            raise ConfigRejected("the multipliers and logits_scaling must be positive", "logits_scaling")
        self._check_experts()

    def _check_experts(self) -> None:
        if not self.num_experts:
            if self.experts_per_token or self.dense_mlp_layers:
                raise ConfigRejected("experts_per_token and dense_mlp_layers need num_experts", "num_experts")
            return
        if self.num_experts < 0 or not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigRejected("experts_per_token must be 1 to num_experts", "experts_per_token")
        if self.moe_intermediate_size <= 0:
            raise ConfigRejected("a mixture of experts needs moe_intermediate_size", "moe_intermediate_size")
        if self.arch != "llama":
            raise ConfigRejected("a mixture of experts is implemented on the llama block only", "num_experts")
        if any(not 0 <= i < self.num_layers for i in self.dense_mlp_layers):
            raise ConfigRejected("a dense MLP layer is not a layer of the model", "dense_mlp_layers")

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is a mixture of experts (else a dense MLP)."""
        return self.num_experts > 0 and layer not in self.dense_mlp_layers

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones)."""
        return self.rotary_dim or self.head_dim

    def has_rope(self, layer: int) -> bool:
        return layer not in self.layers_without_rope

    @property
    def norm_offset(self) -> float:
        """What RMS norms add to their weight: Gemma stores w - 1 and multiplies by 1 + w."""
        return 1.0 if self.arch == "gemma" else 0.0

    @property
    def has_post_norms(self) -> bool:
        """Norms on the attention and MLP outputs before their residual adds (Gemma, OLMo 2)."""
        return self.arch == "gemma" or not self.has_pre_norms

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale > 0 else self.head_dim**-0.5

    @property
    def distinct_windows(self) -> tuple[int, ...]:
        """Every attention family of the model (0 = full), each built once per pass."""
        return tuple(sorted({self.window(i) for i in range(self.num_layers)}))
