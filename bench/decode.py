"""SmolLM2 prefill and decode throughput of the torch driver at batch 1, 8 and 32, side by side
in one run with Hugging Face `transformers` `generate` on the same prompts, weights and dtype, and
with the memory-bandwidth bound (weight bytes read per decode step / measured read bandwidth);
`--peer llamacpp` adds llama.cpp (the `llama-cpp-python` package, built from its sdist on this
machine: `pip install 'llama-cpp-python==0.3.36'`, a bench-only extra) on the same GGUF, batch 1.
Prints the CPU it ran on and which variant each C++ kernel runs.

    python bench/decode.py [--threads N] [--dtype float32,float32+w8a8+compile] [--batches 1,8,32]
                           [--peer llamacpp] [--json PATH]

Each --dtype entry is
DTYPE[+WEIGHTS][+compile][+torchmm][+torchf32][+torchattn][+unpacked][+unfused][+unsplit][+kv16][+graphs]
[+ISA]:
the activation dtype, the weight kind (int8, w8a8; dense when absent), whether the driver runs its
compiled path, (torchmm) whether w8a8 keeps the torch matmul path instead of the C++ kernel,
(torchf32) whether dense float32 decode keeps torch's matmuls instead of the C++ kernel,
(torchattn) whether float32 decode keeps the torch attention path instead of the C++ kernel,
(unpacked) whether int8 weights stay one tensor each instead of one buffer on huge pages,
(unfused) whether w8a8 decode runs the model's own path (eager or compiled) instead of the fused
C++ decode step, (unsplit) whether the fused step's threads each do every row's norms, int8
rounding and SiLU instead of sharing the rows out (from 4 rows on),
(kv16) a float16 KV cache, (graphs) decode passes replayed from CUDA graphs (CUDA only), and
(ISA: avx2, avx2_vnni, portable, ...) the C++ kernels capped at that instruction-set level (the
AVX2 variants measured on an AVX-512 machine). transformers runs once per activation dtype and
batch, on the same prompts as every entry. Prints a table and writes JSON.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge_schema.batch import OutputSpec, RequestSpec, build_forward
from bridge_schema.messages import Hello
from drivers.torch.driver import DTYPES, DriverOptions, TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.weights import weight_arena
from drivers.torch.weights.checkpoint import Checkpoint, load_checkpoint


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def read_bandwidth_gbs(device: str, repeats: int = 5, huge_pages: bool = False) -> float:
    """Best-of sequential read bandwidth of a 512 MiB tensor with the current thread count;
    `huge_pages`: the tensor on transparent huge pages, like packed int8 weights (CPU)."""
    if huge_pages:
        x = weight_arena.allocate(512 * 1024 * 1024)[0].view(torch.float32).fill_(1.0)
    else:
        x = torch.ones(128 * 1024 * 1024, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def weight_bytes(drv: TorchDriver) -> int:
    """Bytes of weights one decode step reads: every parameter and int8 weight buffer once. The
    tied embedding counts once, as the output head (the lookup reads only a few rows); with int8
    weights the head reads its int8 copy, so the dense embedding is not counted."""
    tensors = [t for t in (*drv.model.parameters(), *drv.model.buffers()) if t.dtype != torch.float64]
    if drv.model.output_head is not None:
        emb = drv.model.model.embed_tokens.weight
        tensors = [t for t in tensors if t is not emb]
    # Each byte once: a packed w8a8 linear's weights, scales and sums are views of its `packed`.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    total, end = 0, 0
    for start, stop in spans:
        total += max(0, stop - max(start, end))
        end = max(end, stop)
    return total


def _request(i: int, tokens: list[int], start: int, page_size: int, pages_per: int) -> RequestSpec:
    kv = start + len(tokens)
    pages = list(range(i * pages_per, i * pages_per + (kv + page_size - 1) // page_size))
    return RequestSpec(
        i, tokens, list(range(start, kv)), pages, kv - (len(pages) - 1) * page_size, [OutputSpec(len(tokens) - 1)]
    )


def bench_ours(drv: TorchDriver, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    ps, length = 16, len(prompts[0])
    per = (length + new_tokens + ps - 1) // ps
    b = len(prompts)
    t = time.perf_counter()
    res = drv.forward(build_forward(0, [_request(i, p, 0, ps, per) for i, p in enumerate(prompts)]))
    prefill = time.perf_counter() - t
    last = res.tokens.tolist()
    t = time.perf_counter()
    for s in range(new_tokens):
        res = drv.forward(build_forward(s + 1, [_request(i, [last[i]], length + s, ps, per) for i in range(b)]))
        last = res.tokens.tolist()
    decode = time.perf_counter() - t
    return b * length / prefill, b * new_tokens / decode


def hf_twin(ckpt: Checkpoint, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = ckpt.cfg
    hc = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_eps,
        max_position_embeddings=c.max_position,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(hc).eval()
    model.load_state_dict(ckpt.state, strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype)


class _StepClock:
    """A `generate` streamer that timestamps every step: `put` gets the prompt once, then each
    generated token, so decode time is measured inside one call, without subtracting runs."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_transformers(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    attn = torch.ones_like(ids)
    b, length = ids.shape
    clock = _StepClock(str(device))
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens + 1, do_sample=False, streamer=clock
        )
    # times[0]: prompt accepted; times[1]: first token (prefill done); times[-1]: last token.
    prefill = clock.times[1] - t
    decode = clock.times[-1] - clock.times[1]
    return b * length / prefill, b * new_tokens / decode


def best_of(repeats: int, run: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """The best prefill and the best decode rate of `repeats` runs."""
    results = [run() for _ in range(max(repeats, 1))]
    return max(r[0] for r in results), max(r[1] for r in results)


_FLAGS = (
    "compile", "torchmm", "torchf32", "torchattn", "unpacked", "unfused", "unsplit", "kv16", "graphs",
    *cpu_kernels.ISAS,
)


def isa_of(spec: str) -> str:
    """The instruction-set cap of a --dtype entry (the highest level when it names none)."""
    return next((f for f in spec.split("+")[1:] if f in cpu_kernels.ISAS), cpu_kernels.ISAS[-1])


def make_driver(ckpt: Checkpoint, spec: str, device: str, num_pages: int) -> TorchDriver:
    """A driver for one --dtype entry, after its handshake (built under the entry's ISA cap, which
    the caller keeps while it runs: the cap is per process)."""
    act, *flags = spec.split("+")
    unknown = [f for f in flags if f not in _FLAGS and f not in ("int8", "w8a8")]
    if unknown:
        raise SystemExit(f"unknown flag {unknown[0]!r} in --dtype entry {spec!r}")
    weights = next((f for f in flags if f not in _FLAGS), "dense")
    options = DriverOptions(
        device=device,
        dtype=act,
        num_pages=num_pages,
        weights=weights,
        compile="compile" in flags,
        w8a8_kernel="torchmm" not in flags,
        f32_kernel="torchf32" not in flags,
        attention_kernel="torchattn" not in flags,
        kv_dtype="float16" if "kv16" in flags else "",
        pack_weights="unpacked" not in flags,
        fused_decode="unfused" not in flags,
        cuda_graphs="graphs" in flags,
    )
    drv = TorchDriver(ckpt, options)
    drv.handshake(Hello())
    if "unsplit" in flags:
        if drv.fused is None:
            raise SystemExit(f"--dtype entry {spec!r}: +unsplit needs the fused decode step")
        drv.fused.set_split_rows(1 << 62)  # every thread does every row's own work
    return drv


def interleaved(args: argparse.Namespace, ckpt: Checkpoint) -> None:
    """Decode of every entry at each batch (`--batches`, batch 1 unless given), alternated round
    by round in this process (each round: both bandwidth probes, then each batch's entries'
    prefill and decode, the entries' order reversed every other round); medians over the rounds,
    and each entry's median over the first entry's at the same batch."""
    specs = args.dtype.split(",")
    batches = [int(b) for b in (args.batches or "1").split(",")]
    pages = (args.prompt_len + args.new_tokens + 15) // 16 * max(batches)
    drivers = {}
    rng = np.random.default_rng(0)
    for spec in specs:
        with capped(spec):
            drivers[spec] = make_driver(ckpt, spec, args.device, pages)
            bench_ours(drivers[spec], [rng.integers(0, 49152, 8).tolist()], 2)  # warm up
    rates: dict[tuple[str, int], list[float]] = {(spec, b): [] for spec in specs for b in batches}
    probes: dict[str, list[float]] = {"normal": [], "huge": []}
    load_start = os.getloadavg()
    for r in range(args.interleave):
        probes["normal"].append(read_bandwidth_gbs(args.device, repeats=1))
        probes["huge"].append(read_bandwidth_gbs(args.device, repeats=1, huge_pages=True))
        order = specs if r % 2 == 0 else specs[::-1]
        for b in batches:
            prompts = [rng.integers(0, 49152, args.prompt_len).tolist() for _ in range(b)]
            for spec in order:
                with capped(spec):
                    rates[spec, b].append(bench_ours(drivers[spec], prompts, args.new_tokens)[1])
        print(f"round {r + 1}/{args.interleave} done", file=sys.stderr, flush=True)
    load_end = os.getloadavg()
    probe = {k: float(np.median(v)) for k, v in probes.items()}
    print(f"load average {load_start} at the start, {load_end} at the end")
    print(f"median probes: {probe['normal']:.1f} GB/s (4 KiB pages), {probe['huge']:.1f} GB/s (huge pages)")
    print(
        "| entry | batch | decode tok/s median | min | max | vs first entry | bound | % of bound "
        "| bound (huge-page probe) | % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for b in batches:
        first = float(np.median(rates[specs[0], b]))
        for spec in specs:
            nbytes = weight_bytes(drivers[spec])
            bound, bound_huge = b * probe["normal"] * 1e9 / nbytes, b * probe["huge"] * 1e9 / nbytes
            got = rates[spec, b]
            med = float(np.median(got))
            rows.append(
                {"dtype": spec, "batch": b, "decode_tok_s": got, "median": med, "vs_first": med / first,
                 "bound": bound, "bound_huge": bound_huge}
            )
            print(
                f"| {spec} | {b} | {med:.1f} | {min(got):.1f} | {max(got):.1f} | {med / first:.2f}x | {bound:.1f} | "
                f"{med / bound:.0%} | {bound_huge:.1f} | {med / bound_huge:.0%} |"
            )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "rounds": args.interleave, "load_average": [load_start, load_end]}
    out.write_text(json.dumps({"meta": meta, "probes": probes, "rows": rows}, indent=2))
    print(f"wrote {out}")


def capped(spec: str) -> contextlib.AbstractContextManager[object]:
    """The entry's ISA cap on the C++ kernels (nothing where they are not built)."""
    if cpu_kernels.load(show_progress=False):
        return cpu_kernels.limit_isa(isa_of(spec))
    return contextlib.nullcontext()


def cpu_description() -> dict[str, object]:
    """The CPU model, its vector features, and which variant each C++ kernel runs."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == (platform.processor() or platform.machine()):
                model = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    vector = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "asimd", "sve", "neon")))
    loaded = cpu_kernels.load(show_progress=False)
    return {
        "model": model,
        "features": vector,
        "kernel_isas": cpu_kernels.cpu_isas() if loaded else [],
        "kernels": cpu_kernels.variants() if loaded else {},
        # torch's own kernels and Inductor's generated code: ATEN_CPU_CAPABILITY caps both.
        "torch_isa": torch.backends.cpu.get_cpu_capability(),
    }


def torch_cap_note(specs: list[str], torch_isa: str) -> str:
    """A line for entries capped below AVX-512 while torch's kernels and the compiled graphs' code
    still use AVX-512: such an entry is the AVX2 C++ kernels on this CPU, not an AVX2-only CPU."""
    low = [s for s in specs if isa_of(s) in ("avx2", "avx2_vnni", "portable")]
    if not low or not torch_isa.startswith("AVX512"):
        return ""
    return (
        f"note: {', '.join(low)} cap the C++ kernels only; torch's own kernels and Inductor's generated code run "
        f"{torch_isa} (ATEN_CPU_CAPABILITY=avx2 in the environment caps them too)"
    )


def bench_llamacpp(prompt: list[int], new_tokens: int, threads: int) -> tuple[float, float]:
    """llama.cpp on the same GGUF and prompt, greedy: prefill and decode tokens/s at batch 1."""
    from llama_cpp import Llama

    from drivers.torch.weights.gguf_loader import smollm2_path

    # The context holds the prompt and the new tokens (llama_decode fails past n_ctx), at least 1,024.
    n_ctx = max(1024, (len(prompt) + new_tokens + 255) // 256 * 256)
    llm = _llamacpp_models.get((threads, n_ctx))
    if llm is None:
        llm = Llama(model_path=str(smollm2_path()), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)
        _llamacpp_models[(threads, n_ctx)] = llm
    llm.reset()
    times = []
    t = time.perf_counter()
    for _ in llm.generate(prompt, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) > new_tokens:
            break
    return len(prompt) / (times[0] - t), new_tokens / (times[-1] - times[0])


_llamacpp_models: dict[tuple[int, int], object] = {}


def peer_rows(args: argparse.Namespace, prompt: list[int]) -> list[dict[str, object]]:
    if args.peer != "llamacpp":
        return []
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("--peer llamacpp needs llama-cpp-python: pip install 'llama-cpp-python==0.3.36'") from None
    p, d = best_of(args.repeats, functools.partial(bench_llamacpp, prompt, args.new_tokens, torch.get_num_threads()))
    print(f" llama.cpp B=1   prefill {p:8.1f} tok/s  decode {d:7.1f} tok/s ({llama_cpp.__version__})", flush=True)
    return [{"peer": "llama.cpp", "version": llama_cpp.__version__, "batch": 1, "prefill_tok_s": p, "decode_tok_s": d}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="default: all cores")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (Triton attention; untested so far)")
    parser.add_argument(
        "--dtype",
        default="float32,float32+w8a8+compile,bfloat16+int8",
        help="DTYPE[+int8|+w8a8][+compile][+torchmm][+unpacked], comma-separated",
    )
    parser.add_argument("--batches", default=None, help="comma-separated; default 1,8,32 (with --interleave: 1)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="best of N runs per measurement")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--peer", choices=["", "llamacpp"], default="", help="llamacpp: llama.cpp side by side")
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="N rounds of decode (batch 1 unless --batches) alternating the entries (no transformers)",
    )
    parser.add_argument("--json", default="bench/results/decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"threads: {torch.get_num_threads()} (of {os.cpu_count()} cores); torch {torch.__version__}", flush=True)
    cpu = cpu_description()
    print(f"CPU: {cpu['model']}; features: {' '.join(cpu['features'])}", flush=True)  # type: ignore[arg-type]
    print(f"C++ kernels: {cpu['kernels']} (CPU levels {cpu['kernel_isas']}); torch: {cpu['torch_isa']}", flush=True)
    note = torch_cap_note(args.dtype.split(","), str(cpu["torch_isa"]))
    if note:
        print(note, flush=True)
    ckpt = load_checkpoint("smollm2")
    if args.interleave:
        interleaved(args, ckpt)
        return
    bandwidth = read_bandwidth_gbs(args.device)
    print(f"measured read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in (args.batches or "1,8,32").split(",")]
    prompts = {b: [rng.integers(0, 49152, args.prompt_len).tolist() for _ in range(b)] for b in batches}
    hf: dict[tuple[str, int], tuple[float, float]] = {}  # (activation dtype, batch) -> rates
    twins: dict[str, torch.nn.Module] = {}
    rows = []
    peers = peer_rows(args, prompts[1][0] if 1 in prompts else prompts[batches[0]][0])
    for spec in args.dtype.split(","):
        cap = capped(spec)
        cap.__enter__()
        act = spec.split("+")[0]
        pages = max(batches) * ((args.prompt_len + args.new_tokens + 15) // 16)
        start = time.perf_counter()
        drv = make_driver(ckpt, spec, args.device, pages)
        startup_s = time.perf_counter() - start
        print(f"{spec}: driver ready in {startup_s:.1f} s", flush=True)
        bound_steps = bandwidth * 1e9 / weight_bytes(drv)
        bench_ours(drv, [rng.integers(0, 49152, 8).tolist()], 2)  # warm up
        for b in batches:
            ours_p, ours_d = best_of(args.repeats, functools.partial(bench_ours, drv, prompts[b], args.new_tokens))
            if (act, b) not in hf:
                if act not in twins and not args.no_transformers:
                    twins[act] = hf_twin(ckpt, DTYPES[act]).to(args.device)
                twin = twins.get(act)
                nan = (float("nan"), float("nan"))
                hf[act, b] = (
                    nan
                    if twin is None
                    else best_of(args.repeats, functools.partial(bench_transformers, twin, prompts[b], args.new_tokens))
                )
            hf_p, hf_d = hf[act, b]
            row = {
                "dtype": spec,
                "batch": b,
                "prefill_tok_s": ours_p,
                "decode_tok_s": ours_d,
                "hf_prefill_tok_s": hf_p,
                "hf_decode_tok_s": hf_d,
                "decode_bound_tok_s": bound_steps * b,
                "weight_bytes": weight_bytes(drv),
                "startup_s": startup_s,
            }
            rows.append(row)
            print(
                f"{spec:>9} B={b:<3} prefill {ours_p:8.1f} tok/s (hf {hf_p:8.1f})  decode {ours_d:7.1f} tok/s "
                f"(hf {hf_d:7.1f}, bound {bound_steps * b:7.1f}, {ours_d / (bound_steps * b):4.0%} of bound)",
                flush=True,
            )
        cap.__exit__(None, None, None)
        del drv
    print()
    print("| dtype | batch | prefill tok/s | hf prefill | decode tok/s | hf decode | bound | % of bound | vs hf |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['batch']} | {r['prefill_tok_s']:.0f} | {r['hf_prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.1f} | {r['hf_decode_tok_s']:.1f} | {r['decode_bound_tok_s']:.1f} | "
            f"{r['decode_tok_s'] / r['decode_bound_tok_s']:.0%} | {r['decode_tok_s'] / r['hf_decode_tok_s']:.2f}x |"
        )
    for peer in peers:
        print()
        print(f"| dtype | prefill tok/s | prefill vs {peer['peer']} | decode tok/s (B=1) | decode vs {peer['peer']} |")
        print("|---|---|---|---|---|")
        name, pre, dec = f"{peer['peer']} {peer['version']}", peer["prefill_tok_s"], peer["decode_tok_s"]
        print(f"| {name} | {pre:.0f} | 1.00x | {dec:.1f} | 1.00x |")
        for r in rows:
            if r["batch"] == 1:
                print(
                    f"| {r['dtype']} | {r['prefill_tok_s']:.0f} | {r['prefill_tok_s'] / peer['prefill_tok_s']:.2f}x | "  # type: ignore[operator]
                    f"{r['decode_tok_s']:.1f} | {r['decode_tok_s'] / peer['decode_tok_s']:.2f}x |"  # type: ignore[operator]
                )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "device": args.device,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "bandwidth_gb_s": bandwidth,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "cpu": cpu,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows, "peers": peers}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
