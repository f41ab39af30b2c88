"""The model configuration the torch driver runs: one typed object built by a loader, validated
once, passed down. It knows the model's shape, not where the weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from drivers.errors import ConfigRejected

ARCHITECTURES = ("llama", "gemma")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    `arch` "llama" covers Llama 2/3, SmolLM2 and Qwen2 (with `attention_bias`); "gemma" is the
    Gemma-2/3 style block: (1 + w) RMS norms, sandwich norms, GELU-tanh MLP, scaled embeddings,
    q/k norms, and per-layer sliding windows.
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
    # Llama 3.1+ RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_position).
    rope_llama3: tuple[float, float, float, int] | None = None
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
    qk_norm: bool = False
    final_logit_softcap: float = 0.0
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

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale > 0 else self.head_dim**-0.5

    @property
    def distinct_windows(self) -> tuple[int, ...]:
        """Every attention family of the model (0 = full), each built once per pass."""
        return tuple(sorted({self.window(i) for i in range(self.num_layers)}))
