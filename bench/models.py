"""The models users bring, measured side by side with a peer in one run; prints tables and writes
JSON (bench/results/models.json). Not part of the test run.

    python bench/models.py [--families] [--gguf-3b] [--threads 2] [--out bench/results/models.json]

--families: per family (docs/models.md), a small random checkpoint saved by transformers
(hidden 512, 4 layers, vocab 8,192; MoE with 4 experts, top 2): load time and peak RSS of the torch
driver's load (in a child process, above its RSS after imports), and decode tok/s at batch 1 and 8
for the driver (float32) next to transformers' `generate` on the same weights.

--gguf-3b: a Llama-3.2-3B-shaped model (28 layers, hidden 3,072, 24 query and 8 KV heads, FFN
8,192, tied head) with random weights and SmolLM2's 49,152-token vocabulary (the tokenizer at hand
without a download), written as an F16 GGUF and quantized to Q4_K_M by llama.cpp's own
`llama_model_quantize` at bench time (in a temporary folder, never committed; ~6 GB of disk
while it runs). Then, each in its own process: the torch driver with `--weights w8a8` (which
streams the file into int8: its float model would not fit in half the memory) and llama.cpp on
the same file: load time, peak RSS, the loaded model's bytes, decode tok/s at batch 1.
Needs llama-cpp-python (`pip install 'llama-cpp-python==0.3.36'`, built from its sdist).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# family -> (model_type, overrides) for the --families table.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {"sliding_window": 64}),
    "gemma3": ("gemma3_text", {"sliding_window": 64}),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 512}),
}
SHAPE: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    pad_token_id=None,
)
LLAMA_3B: dict[str, int] = dict(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192)
PROMPT, NEW_TOKENS = 32, 32


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    """Start VmHWM afresh (Linux: writing 5 to clear_refs resets the peak to the current RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# ------------------------------------------------------------------ children (one measurement each)


def child_family(model_type: str, overrides: dict[str, Any], threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from bench.decode import bench_ours, bench_transformers, best_of
    from drivers.torch.driver import DriverOptions, TorchDriver
    from drivers.torch.weights.checkpoint import load_checkpoint
    from tests.drivers.torch.helpers import hf_model, write_tiny_family

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_family(Path(tmp) / "m", model_type, **{**SHAPE, **overrides})
        _reset_peak()
        base = _rss_mib("VmRSS")
        t = time.perf_counter()
        drv = TorchDriver(load_checkpoint(str(path), show_progress=False), DriverOptions(num_pages=512))
        load_s = time.perf_counter() - t
        peak = _rss_mib("VmHWM") - base
        from bridge_schema.messages import Hello

        drv.handshake(Hello())
        rng = torch.Generator().manual_seed(0)
        row: dict[str, Any] = {"load_s": round(load_s, 2), "peak_rss_mib": round(peak, 1)}
        hf = hf_model(path)
        for batch in (1, 8):
            prompts = torch.randint(1, SHAPE["vocab_size"], (batch, PROMPT), generator=rng).tolist()
            _, ours = best_of(2, lambda p=prompts: bench_ours(drv, p, NEW_TOKENS))
            _, theirs = best_of(2, lambda p=prompts: bench_transformers(hf, p, NEW_TOKENS))
            row[f"b{batch}_tok_s"] = round(ours, 1)
            row[f"b{batch}_transformers_tok_s"] = round(theirs, 1)
        return row


def child_ours_gguf(path: str, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from bench.decode import bench_ours, best_of, weight_bytes
    from bridge_schema.messages import Hello
    from drivers.torch import __main__ as driver_main
    from drivers.torch.driver import DTYPES, DriverOptions, TorchDriver

    options = DriverOptions(weights="w8a8", num_pages=256)
    _reset_peak()
    base = _rss_mib("VmRSS")
    t = time.perf_counter()
    streamed = driver_main._streams_int8(path, options)
    ckpt = driver_main._load(path, DTYPES[options.dtype] if streamed else None)
    drv = TorchDriver(ckpt, options)
    load_s = time.perf_counter() - t
    peak = _rss_mib("VmHWM") - base
    drv.handshake(Hello())
    loaded = weight_bytes(drv) / 2**20
    prompt = torch.randint(1, ckpt.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0)).tolist()
    _, decode = best_of(3, lambda: bench_ours(drv, prompt, NEW_TOKENS))
    return {
        "engine": "wafer (torch driver, w8a8)",
        "streamed": streamed,
        "load_s": round(load_s, 1),
        "peak_rss_mib": round(peak, 0),
        "loaded_mib": round(loaded, 0),
        "peak_over_loaded": round(peak / loaded, 3),
        "decode_b1_tok_s": round(decode, 2),
        "prompt": prompt[0],
    }


def child_llamacpp(path: str, threads: int, prompt: list[int]) -> dict[str, Any]:
    from llama_cpp import Llama, __version__

    _reset_peak()
    base = _rss_mib("VmRSS")
    t = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t
    peak = _rss_mib("VmHWM") - base
    best = 0.0
    for _ in range(3):
        llm.reset()
        times = []
        for _token in llm.generate(prompt, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) > NEW_TOKENS:
                break
        best = max(best, NEW_TOKENS / (times[-1] - times[0]))
    return {
        "engine": f"llama.cpp {__version__}",
        "load_s": round(load_s, 1),
        "peak_rss_mib": round(peak, 0),
        "loaded_mib": round(Path(path).stat().st_size / 2**20, 0),
        "decode_b1_tok_s": round(best, 2),
    }


def _child(args: list[str]) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (its RSS is its own)."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"child {args[0]} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------ the 3B GGUF


def write_3b_f16(path: Path) -> None:
    """The 3B-shaped model with random weights (std 0.02; norms 1) as an F16 GGUF, SmolLM2's
    tokenizer metadata copied in."""
    import gguf
    import numpy as np

    from drivers.torch.weights.gguf_loader import smollm2_path

    src = gguf.GGUFReader(smollm2_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    s = LLAMA_3B
    head_dim = s["hidden"] // s["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("llama-3.2-3b-shaped-random")
    w.add_context_length(8192)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in src.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(name, value)
            elif kind == gguf.GGUFValueType.STRING:
                w.add_string(name, value)
            elif kind == gguf.GGUFValueType.BOOL:
                w.add_bool(name, value)
            else:
                w.add_uint32(name, int(value))
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", rand(vocab, s["hidden"]))
    w.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(s["hidden"], dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", rand(s["hidden"], s["hidden"]))
        w.add_tensor(p + "attn_k.weight", rand(kv, s["hidden"]))
        w.add_tensor(p + "attn_v.weight", rand(kv, s["hidden"]))
        w.add_tensor(p + "attn_output.weight", rand(s["hidden"], s["hidden"]))
        w.add_tensor(p + "ffn_gate.weight", rand(s["ffn"], s["hidden"]))
        w.add_tensor(p + "ffn_up.weight", rand(s["ffn"], s["hidden"]))
        w.add_tensor(p + "ffn_down.weight", rand(s["hidden"], s["ffn"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def quantize_q4_k_m(src: Path, dst: Path, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit("llama_model_quantize failed")


def gguf_3b(threads: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("WAFER_BENCH_TMP")) as tmp:
        f16, q4 = Path(tmp) / "3b-f16.gguf", Path(tmp) / "3b-q4_k_m.gguf"
        t = time.perf_counter()
        print("writing the 3B-shaped F16 GGUF (random weights)", flush=True)
        write_3b_f16(f16)
        print(f"  {f16.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.0f} s; quantizing", flush=True)
        quantize_q4_k_m(f16, q4, threads)
        f16.unlink()
        print(f"  Q4_K_M: {q4.stat().st_size / 2**30:.2f} GiB", flush=True)
        ours = _child(["ours_gguf", str(q4), str(threads)])
        print(f"  wafer: {ours}", flush=True)
        theirs = _child(["llamacpp", str(q4), str(threads), json.dumps(ours.pop("prompt"))])
        print(f"  llama.cpp: {theirs}", flush=True)
        ours["ratio_vs_llamacpp"] = round(ours["decode_b1_tok_s"] / theirs["decode_b1_tok_s"], 3)
        return [ours, theirs]


# ------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", action="store_true")
    parser.add_argument("--gguf-3b", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/models.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = json.loads(args.child)
        if kind == "family":
            result = child_family(rest[0], json.loads(rest[1]), int(rest[2]))
        elif kind == "ours_gguf":
            result = child_ours_gguf(rest[0], int(rest[1]))
        else:
            result = child_llamacpp(rest[0], int(rest[1]), json.loads(rest[2]))
        print(json.dumps(result))
        return
    if not args.families and not args.gguf_3b:
        args.families = args.gguf_3b = True
    report: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "threads": args.threads}
    try:
        from bench.machine import cpu_name

        report["cpu"] = cpu_name()
    except ImportError:
        pass
    if args.families:
        rows = []
        print(
            f"{'family':10} {'load s':>7} {'peak MiB':>9} {'B=1 tok/s':>10} {'(tf)':>8} {'B=8 tok/s':>10} {'(tf)':>8}"
        )
        for name, (model_type, overrides) in FAMILIES.items():
            row = {"family": name, **_child(["family", model_type, json.dumps(overrides), str(args.threads)])}
            rows.append(row)
            print(
                f"{name:10} {row['load_s']:7.2f} {row['peak_rss_mib']:9.1f} {row['b1_tok_s']:10.1f} "
                f"{row['b1_transformers_tok_s']:8.1f} {row['b8_tok_s']:10.1f} {row['b8_transformers_tok_s']:8.1f}",
                flush=True,
            )
        report["families"] = rows
    if args.gguf_3b:
        report["gguf_3b_q4_k_m"] = gguf_3b(args.threads)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
