"""`TorchDriver`: the `Driver` protocol over a real model. Owns the device: the weights, the page
memory (allocated once per resolved handshake), loaded adapters and the sampling generator.
Each `forward` is validate -> plan -> model -> sample; nothing here does tensor math itself."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.config_rules import check_prefix_match_unit
from bridge_schema.errors import ConfigError
from bridge_schema.messages import SAMPLER_CHAIN, Adapter, Copy, Forward, ForwardResult, Handshake, Hello
from drivers.errors import ConfigRejected, RequestRejected
from drivers.sampler_chain import SlotTokens
from drivers.torch.batch_plan import CacheLimits, PassPlan, build_plan
from drivers.torch.kernels import cpu_kernels
from drivers.torch.kernels.paged_attention import PagedAttention
from drivers.torch.kv_cache import PagedKVCache
from drivers.torch.model import Transformer
from drivers.torch.progress import Progress
from drivers.torch.rope import model_inv_freqs
from drivers.torch.runners import compiled
from drivers.torch.runners.compiled import CompiledModel
from drivers.torch.runners.cuda_graphs import DecodeGraphs
from drivers.torch.runners.fused_decode import FusedDecode, unsupported
from drivers.torch.sampling import sample
from drivers.torch.weights.checkpoint import Checkpoint
from drivers.torch.weights.cpu_layout import transpose_linears
from drivers.torch.weights.fusion import fuse_projections
from drivers.torch.weights.lora import LoraBatch, LoraWeights, load_peft
from drivers.torch.weights.quantize import quantize_int8
from drivers.torch.weights.smoothing import calibration_tokens, cannot_smooth, smooth

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# On the CPU a fill's attention runs over all its keys for every query (SDPA with a mask skips
# nothing): in chunks of 512 tokens, the later keys of a long prompt are not attended to by its
# earlier queries. Chunks of 256 were 5% faster again at 4,000 tokens, 512 keeps passes fuller.
CPU_FILL_CHUNK = 512


@dataclass(frozen=True, slots=True)
class DriverOptions:
    device: str = "cpu"
    dtype: str = "float32"
    kv_dtype: str = ""  # the KV cache's dtype; "" = `dtype`. On the CPU, any of DTYPES
    page_size: int = 16  # used when Hello asks for 0
    num_pages: int = 256  # used when Hello asks for 0
    max_requests_per_pass: int = 64
    max_tokens_per_pass: int = 4096
    max_mask_bytes: int = 64 * 1024 * 1024
    max_probe_k: int = 20
    # The largest chunk of one request's fill the handshake asks the host for: -1 = 512 on the CPU
    # (a long prompt's queries then attend to the keys before them only: ~1.9x faster at 4,000
    # tokens, docs/performance.md), none on CUDA; 0 = none.
    max_fill_chunk_tokens: int = -1
    seed: int = 0
    # "dense" (the activation dtype), "int8" (weight-only, bf16/fp16 only) or "w8a8" (int8 weights
    # and per-row int8 activations in the matmuls): see `quantize.py`.
    weights: str = "dense"
    # w8a8: smooth the activations' outlier channels into the weights first (`smoothing.py`).
    smooth: bool = True
    # w8a8 on the CPU: the C++ kernel of `cpu_kernels.py` where it builds; False keeps the torch
    # path (same results; for side-by-side measurements).
    w8a8_kernel: bool = True
    # Dense float32 on the CPU: decode's matmuls (up to 24 rows) through the C++ op of
    # `cpu_kernels.py` where it builds; False keeps torch's (for side-by-side measurements).
    f32_kernel: bool = True
    # Decode passes in float32 on the CPU: the C++ attention of `cpu_kernels.py` where it builds;
    # False keeps the torch path (same results to float32 rounding; for side-by-side measurements).
    attention_kernel: bool = True
    # int8 weights on the CPU: one buffer in step order on huge pages (`weight_arena.py`); False
    # keeps one tensor per weight (same results; for side-by-side measurements).
    pack_weights: bool = True
    # w8a8 or dense float32 on the CPU: decode passes as one C++ call (`fused_decode.py`) where the
    # model allows it; False keeps the model's own path, eager or compiled (for side-by-side runs).
    fused_decode: bool = True
    # Compile each layer with torch.compile (CPU only; see `compiled.py`); compiles at the handshake.
    compile: bool = False
    # CUDA: replay decode passes from CUDA graphs (`cuda_graphs.py`). Off until `make gpu-check` has
    # run the capture on hardware (the bucket logic is tested on the CPU, uncaptured).
    cuda_graphs: bool = False


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The model with the checkpoint's weights; every parameter must be present, none left over.
    The projections of a checkpoint streamed for int8 (`ckpt.int8`) stay on the meta device, for
    `quantize_int8` to fill from the file."""
    with torch.device("meta"):
        model = Transformer(ckpt.cfg)
    state = dict(ckpt.state)
    if ckpt.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    streamed = set() if ckpt.int8 is None else set(ckpt.int8.spans)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state) - streamed, (set(state) | streamed) - expected
    if missing or unexpected:
        raise ConfigRejected(
            f"checkpoint does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}",
            "model",
        )
    if ckpt.int8 is not None:
        if ckpt.int8.dtype != dtype:
            raise ConfigRejected(f"the checkpoint was streamed for {ckpt.int8.dtype} activations, not {dtype}", "dtype")
        # What `model.to` does to a loaded model, done to the loaded tensors (meta ones cannot move).
        moved = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        model.load_state_dict(moved, assign=True, strict=False)
        model.eval()
    else:
        model.load_state_dict(state, assign=True)
        # RoPE buffers were created on the meta device: compute them for real, after the dtype cast,
        # because bf16 inverse frequencies would misplace every rotation at long positions.
        model.inv_freq = model.inv_freq_local = torch.empty(0)
        model = model.to(device=device, dtype=dtype).eval()
    inv_freq, inv_freq_local = model_inv_freqs(ckpt.cfg)
    model.inv_freq, model.inv_freq_local = inv_freq.to(device), inv_freq_local.to(device)
    return model


class TorchDriver:
    def __init__(self, ckpt: Checkpoint, options: DriverOptions = DriverOptions()) -> None:
        if options.dtype not in DTYPES:
            raise ConfigRejected(f"dtype must be one of {sorted(DTYPES)}", "dtype")
        if options.kv_dtype and options.kv_dtype not in DTYPES:
            raise ConfigRejected(f"kv_dtype must be one of {sorted(DTYPES)}", "kv_dtype")
        self.options = options
        self.ckpt = ckpt
        self.cfg = ckpt.cfg
        self.device = torch.device(options.device)
        self.dtype = DTYPES[options.dtype]
        self.kv_dtype = DTYPES[options.kv_dtype or options.dtype]
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ConfigRejected("a KV dtype other than the model's is implemented for the CPU only", "kv_dtype")
        if ckpt.int8 is not None and options.weights == "dense":
            raise ConfigRejected("the checkpoint was loaded for int8 weights (no float projections)", "weights")
        self.model = fuse_projections(build_model(ckpt, self.device, self.dtype))
        if options.weights == "w8a8" and options.smooth:
            if ckpt.int8 is not None:
                # Smoothing needs the whole float model for its calibration pass.
                log.info("w8a8 weights streamed from the GGUF file are not smoothed")
            elif reason := cannot_smooth(self.cfg):
                log.info("w8a8 weights are not smoothed (smoothing does not take %s)", reason)
            else:
                self.model = smooth(self.model, calibration_tokens(ckpt.tokenizer, ckpt.cfg.vocab_size))
        if options.weights != "dense":
            rows = None if ckpt.int8 is None else ckpt.int8.int8_rows
            self.model = quantize_int8(self.model, options.weights, options.w8a8_kernel, options.pack_weights, rows)
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            self.model = transpose_linears(self.model, options.f32_kernel and cpu_kernels.load())
        # The Triton and C++ attention kernels have no logit soft cap: such models attend in torch.
        softcap = self.cfg.attn_logit_softcap > 0
        if softcap and self.device.type == "cuda":
            log.info("attention runs in torch, not Triton (the kernel does not take a logit soft cap)")
        self.use_triton = self.device.type == "cuda" and not softcap
        self.attention_kernel = (
            options.attention_kernel
            and not softcap
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and cpu_kernels.load()
        )
        if self.device.type == "cpu":
            log.info("CPU kernels: %s", cpu_kernels.describe())
        self.compiled: CompiledModel | None = None
        if options.compile:
            if self.device.type != "cpu":
                raise ConfigRejected("--compile is implemented for the CPU only", "compile")
            if reason := compiled.unsupported(self.cfg):
                log.info("passes run the model's own path, not compiled (the compiled graphs do not take %s)", reason)
            else:
                self.compiled = CompiledModel(self.model)
        self.cache: PagedKVCache | None = None
        self.limits: CacheLimits | None = None
        self.slot_tokens = SlotTokens(0, 1)  # the token in each KV slot, made with the cache
        self.graphs: DecodeGraphs | None = None
        self.fused: FusedDecode | None = None
        self.adapters: dict[int, LoraWeights] = {}
        self.generator = torch.Generator().manual_seed(options.seed)
        self.stats: dict[str, int | float | str] = {"forwards": 0, "tokens": 0, "outputs": 0, "forward_s": 0.0}

    # ------------------------------------------------------------ protocol

    def handshake(self, hello: Hello, warm_up: bool = True) -> Handshake:
        """Allocate the pages the Hello asks for (new ones only when their shape changed) and, with
        --compile and new pages, compile the graphs (`warm_up`; a tensor-parallel rank runs it
        after the group has its pages, since its passes reduce over the group)."""
        o = self.options
        page_size = hello.page_size or o.page_size
        num_pages = hello.num_pages or o.num_pages
        if page_size <= 0 or num_pages <= 0:
            raise ConfigRejected("page_size and num_pages must be positive", "page_size")
        try:
            check_prefix_match_unit(hello.prefix_match_unit, page_size, hello.speculation_depth)
        except ConfigError as exc:
            raise ConfigRejected(exc.detail, exc.field) from None
        cfg = self.cfg
        if self.cache is None or (self.cache.page_size, self.cache.num_pages) != (page_size, num_pages):
            if self.cache is not None and self.compiled is not None:
                self.compiled = CompiledModel(self.model)  # the old one's graphs hold the old pages (frozen)
            self.cache = self.fused = None  # free the old pages before allocating the new ones
            self.cache = PagedKVCache(
                cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device
            )
            fresh = True
        else:
            fresh = False
        max_context = min(cfg.max_position, num_pages * page_size)
        self.limits = CacheLimits(page_size, num_pages, cfg.vocab_size, max_context, o.max_probe_k)
        if fresh:
            self.fused = self._fused_decode(self.cache)
            self.slot_tokens = SlotTokens(num_pages, page_size)
        if fresh and self.device.type == "cuda" and o.cuda_graphs and self.use_triton:
            self.graphs = DecodeGraphs(cfg, self.model, self.cache, max_context, o.max_requests_per_pass)
        if fresh and self.compiled is not None and warm_up:
            self.warm_up()  # the new pages hold nothing yet, so the warm-up may write into them
        tok = self.ckpt.tokenizer
        return Handshake(
            driver_kind="torch",
            model_name=self.ckpt.model_name,
            vocab_size=cfg.vocab_size,
            page_size=page_size,
            num_pages=num_pages,
            max_context=max_context,
            max_requests_per_pass=o.max_requests_per_pass,
            max_tokens_per_pass=o.max_tokens_per_pass,
            max_mask_bytes=o.max_mask_bytes,
            max_probe_k=o.max_probe_k,
            max_fill_chunk_tokens=self.fill_chunk_tokens(),
            capabilities=[
                "attention_mask",
                "logit_mask",
                "probes",
                "adapters",
                "copy",
                "sliding_window",
                SAMPLER_CHAIN,
            ],
            tokenizer_kind="huggingface" if tok is not None else "bytes",
            tokenizer_data=tok.to_str() if tok is not None else "",
            chat_template=self.ckpt.chat_template,
            stop_token_ids=np.array(self.ckpt.stop_token_ids, dtype=np.uint32),
            control_token_ids=np.array(self.ckpt.control_token_ids, dtype=np.uint32),
            driver_info=self.info(),
        )

    def _fused_decode(self, cache: PagedKVCache) -> FusedDecode | None:
        """The fused decode step over `cache`, where the options ask for it (w8a8, or dense float32,
        on the CPU) and the model allows it (logged where it does not)."""
        o = self.options
        dense32 = o.weights == "dense" and self.dtype == torch.float32
        if not (o.fused_decode and (o.weights == "w8a8" or dense32) and self.device.type == "cpu"):
            return None
        reason = unsupported(self.model, cache)
        if reason:
            log.info("decode passes run the model's own path (the fused decode step does not take %s)", reason)
            return None
        fused = FusedDecode(self.model, cache)
        log.info("decode passes run the fused decode step (%s)", fused.variant())
        return fused

    def faster_configuration(self) -> str:
        """What to pass for faster decode on this CPU, or "" when this already is the fast path
        (w8a8 with a vector kernel, compiled, a float16 KV cache) or none is known (not the CPU,
        not float32). A float16 cache halves the bytes attention reads; its cost in accuracy is
        ~1e-6 nats of KL a token against w8a8's ~0.03 (bench/kv_quality.py, docs/performance.md)."""
        o = self.options
        if self.device.type != "cpu" or o.dtype != "float32":
            return ""
        if not cpu_kernels.load() or (variant := cpu_kernels.variants()["w8a8"]) == "portable":
            return ""
        can_compile = not (o.compile or compiled.unsupported(self.cfg))
        flags = ([] if o.weights == "w8a8" else ["--weights", "w8a8"]) + (["--compile"] if can_compile else [])
        flags += ["--kv-dtype", "float16"] if self.kv_dtype == torch.float32 else []
        if not flags:
            return ""
        serve = " ".join(f"--driver-arg={f}" for f in flags)
        return (
            f"faster on this CPU: {' '.join(flags)} (int8 matmuls run the {variant} kernel here; w8a8 costs some "
            f"accuracy, a float16 KV cache far less, and --compile a few minutes at the first start: "
            f"docs/torch-driver.md; with wafer serve: {serve})"
        )

    def fill_chunk_tokens(self) -> int:
        """The handshake's `max_fill_chunk_tokens` (see `DriverOptions`)."""
        chosen = self.options.max_fill_chunk_tokens
        return chosen if chosen >= 0 else (CPU_FILL_CHUNK if self.device.type == "cpu" else 0)

    def info(self) -> dict[str, int | float | str]:
        """The handshake's `driver_info` and part of `health`: what this driver runs on."""
        o = self.options
        info: dict[str, int | float | str] = {
            "device": str(self.device),
            "dtype": o.dtype,
            "weights": o.weights,
            "compile": int(o.compile),
            # Decode passes: the fused C++ step (with its kernels' variants), or the model's own path.
            "decode_step": f"fused ({self.fused.variant()})" if self.fused is not None else "model",
        }
        if self.device.type == "cpu":
            info["cpu_kernels"] = cpu_kernels.describe()
            info["threads"] = torch.get_num_threads()
        return info

    @torch.inference_mode()
    def forward(self, request: Forward) -> ForwardResult:
        start = time.perf_counter()
        plan, lora = self.plan_pass(request)
        return self.sample_pass(request, plan, self.run_model(plan, lora, plan.out_tokens), start)

    @torch.inference_mode()
    def logits(self, request: Forward) -> torch.Tensor:
        """Raw float32 logits [O, V] of the output rows (for tests and benches); writes KV."""
        return self._run(request)[1]

    def plan_pass(self, request: Forward) -> tuple[PassPlan, LoraBatch | None]:
        """Check `request` against this driver's state and plan it; raises before any compute."""
        if self.cache is None or self.limits is None:
            raise RequestRejected("no handshake yet", "id")
        ids = request.adapter_ids
        adapted = ids.size > 0 and int(ids.max()) >= 0  # most passes run the base model only
        if adapted:
            bad = [int(a) for a in ids if a >= 0 and int(a) not in self.adapters]
            if bad:
                raise RequestRejected(f"adapter {bad[0]} is not loaded", "adapter_ids")
        plan = build_plan(request, self.limits, self.device)
        if not adapted:
            return plan, None
        token_adapter = np.repeat(ids.astype(np.int64), plan.num_q_np)
        return plan, LoraBatch(self.adapters, token_adapter, self.device)

    def run_model(self, plan: PassPlan, lora: LoraBatch | None, rows: torch.Tensor) -> torch.Tensor:
        """Run the model over a planned pass (writing its KV); float32 logits [len(rows), V]."""
        assert self.cache is not None
        if self.graphs is not None and lora is None and self.model.reduce is None:
            logits = self.graphs.run(plan, rows)
            if logits is not None:
                return logits
        if self.fused is not None and lora is None and self.fused.takes(plan):
            attend = PagedAttention(self.cfg, self.cache, plan, self.use_triton)
            return self.fused(plan, attend, rows)
        if self.compiled is not None and lora is None:
            attend = PagedAttention(
                self.cfg, self.cache, plan, self.use_triton, for_compiled=True, kernel=self.attention_kernel
            )
            return self.compiled(plan.tokens, plan.positions, attend, rows)
        attend = PagedAttention(self.cfg, self.cache, plan, self.use_triton, kernel=self.attention_kernel)
        return self.model(plan.tokens, plan.positions, attend, rows, lora)

    def sample_pass(self, request: Forward, plan: PassPlan, logits: torch.Tensor, start: float) -> ForwardResult:
        """Sample the output rows' `logits` and count the pass (begun at perf_counter `start`)."""
        assert plan.sampling is not None, "a sampled pass is planned by build_plan"
        self.slot_tokens.write(request)
        s = sample(logits, request, plan.out_tokens_np, plan.sampling, self.generator, self.slot_tokens)
        self.stats["forwards"] = int(self.stats["forwards"]) + 1
        self.stats["tokens"] = int(self.stats["tokens"]) + len(request.tokens)
        self.stats["outputs"] = int(self.stats["outputs"]) + len(s.tokens)
        self.stats["forward_s"] = float(self.stats["forward_s"]) + time.perf_counter() - start
        return ForwardResult(
            tokens=s.tokens,
            logprobs=s.logprobs,
            topk_indptr=s.topk_indptr,
            topk_ids=s.topk_ids,
            topk_logprobs=s.topk_logprobs,
            dist_indptr=s.dist_indptr,
            dists=s.dists,
        )

    def _run(self, request: Forward) -> tuple[PassPlan, torch.Tensor]:
        plan, lora = self.plan_pass(request)
        return plan, self.run_model(plan, lora, plan.out_tokens)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every graph later passes use before serving: one token, two one-token requests,
        one three-token request; with passes over the first slots of the freshly allocated pages."""
        assert self.limits is not None
        ps = self.limits.page_size
        per_context = -(-3 // ps)  # pages for three tokens
        # With too few pages for a pass, its graph compiles on first use instead.
        passes = [s for s in ([1], [1, 1], [3]) if len(s) * per_context <= self.limits.num_pages]
        progress = Progress("compiling the model (cached on disk for the next start)", len(passes))
        progress.update(0)
        for step, sizes in enumerate(passes):
            specs = []
            for i, n in enumerate(sizes):
                pages = list(range(i * per_context, i * per_context + -(-n // ps)))
                outputs = [OutputSpec(row) for row in range(n)]
                specs.append(RequestSpec(i, [0] * n, list(range(n)), pages, n - (len(pages) - 1) * ps, outputs))
            self._run(build_forward(0, specs))
            progress.update(step + 1)

    @torch.inference_mode()
    def copy(self, request: Copy) -> None:
        if self.cache is None:
            raise RequestRejected("no handshake yet", "id")
        self.cache.copy_pages([int(p) for p in request.src_pages], [int(p) for p in request.dst_pages])
        self.slot_tokens.copy(request.src_pages, request.dst_pages)

    def adapter(self, request: Adapter) -> None:
        if request.op == "load":
            self.adapters[request.adapter_id] = load_peft(
                Path(request.path), self.cfg.num_layers, self.dtype, self.device
            )
        elif request.op == "unload":
            if self.adapters.pop(request.adapter_id, None) is None:
                raise RequestRejected(f"adapter {request.adapter_id} is not loaded", "adapter_id")
        else:
            raise RequestRejected(f"op must be 'load' or 'unload', got {request.op!r}", "op")

    def health(self) -> dict[str, int | float | str]:
        return {**self.stats, **self.info(), "adapters": len(self.adapters)}
