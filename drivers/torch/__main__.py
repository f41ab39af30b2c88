"""`python -m drivers.torch --model smollm2|PATH --device cpu|cuda --dtype ... --listen ADDR
[--tensor-parallel N]`. With N > 1 this process is rank 0 and starts ranks 1..N-1 as
`python -m drivers.torch ... --tp-rank R` (`parallel/tp_driver.py`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from drivers.errors import ConfigRejected
from drivers.serve import add_serve_arguments, configure_logging, serve_forever
from drivers.torch.driver import DTYPES, DriverOptions, TorchDriver
from drivers.torch.kernels import cpu_kernels
from drivers.torch.parallel.rank_group import join_group, rank_device, start_group
from drivers.torch.parallel.tp_driver import (
    TensorParallelDriver,
    build_rank_driver,
    check_options,
    follow,
    scatter_shards,
)
from drivers.torch.weights.checkpoint import Checkpoint, load_checkpoint
from drivers.torch.weights.gguf_loader import smollm2_path
from drivers.torch.weights.quantize import WEIGHT_KINDS


def main(argv: list[str] | None = None) -> None:
    d = DriverOptions()
    parser = argparse.ArgumentParser(prog="python -m drivers.torch", description="wafer's torch driver")
    add_serve_arguments(parser)
    parser.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a Hugging Face directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES))
    parser.add_argument(
        "--kv-dtype",
        default="",
        choices=["", *sorted(DTYPES)],
        help="the KV cache's dtype (default: --dtype); float16 on a float32 model halves the bytes attention reads",
    )
    parser.add_argument(
        "--weights",
        default="dense",
        choices=WEIGHT_KINDS,
        help="int8: weight-only, bf16/fp16; w8a8: int8 weights and per-row int8 activations in the matmuls",
    )
    parser.add_argument(
        "--no-smooth",
        action="store_true",
        help="w8a8: quantize without smoothing the activations' outlier channels into the weights first",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="CPU: compile each layer with torch.compile at startup (tens of seconds the first time)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="CUDA: replay decode passes from captured CUDA graphs (not yet run on hardware; docs/torch-driver.md)",
    )
    parser.add_argument("--page-size", type=int, default=d.page_size, help="used when the host asks for 0")
    parser.add_argument("--num-pages", type=int, default=d.num_pages, help="used when the host asks for 0")
    parser.add_argument("--max-requests-per-pass", type=int, default=d.max_requests_per_pass)
    parser.add_argument("--max-tokens-per-pass", type=int, default=d.max_tokens_per_pass)
    parser.add_argument(
        "--max-fill-chunk-tokens",
        type=int,
        default=d.max_fill_chunk_tokens,
        help="the largest chunk of one prompt per pass to ask the host for (-1: 512 on the CPU, none on CUDA; 0: none)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    parser.add_argument(
        "--cpu-isa",
        default="",
        choices=["", *cpu_kernels.ISAS],
        help="cap the C++ CPU kernels at this instruction-set level (default: the best the CPU has)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        help="shard the model over N ranks (processes; gloo on the CPU, NCCL over cuda:0..N-1); "
        "N must divide the model's KV heads (docs/operating.md)",
    )
    parser.add_argument(
        "--tp-timeout-s", type=float, default=300.0, help="how long a rank waits at start-up or in one collective"
    )
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0
    parser.add_argument("--tp-store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tp-parent", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_isa and cpu_kernels.load():
        cpu_kernels.set_isa_cap(args.cpu_isa)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: this torch build has no CUDA device")
    options = DriverOptions(
        device=args.device,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_requests_per_pass=args.max_requests_per_pass,
        max_tokens_per_pass=args.max_tokens_per_pass,
        max_fill_chunk_tokens=args.max_fill_chunk_tokens,
        seed=args.seed,
        weights=args.weights,
        smooth=not args.no_smooth,
        compile=args.compile,
        cuda_graphs=args.cuda_graphs,
    )
    if args.tp_rank:
        _follow(args, options)
        return
    try:
        driver = _build(args, options, sys.argv[1:] if argv is None else argv)
    except ConfigRejected as exc:
        print(f"python -m drivers.torch: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"[wafer torch] {driver.ckpt.model_name} ready on {args.device} ({args.dtype})", file=sys.stderr, flush=True)
    hint = driver.faster_configuration()
    if hint:
        print(f"[wafer torch] {hint}", file=sys.stderr, flush=True)
    try:
        serve_forever(driver, args.listen, args.max_frame_bytes)
    finally:
        if isinstance(driver, TensorParallelDriver):
            driver.close()


def _load(model: str, int8_dtype: torch.dtype | None = None) -> Checkpoint:
    """The checkpoint `model` names (`int8_dtype`: see `load_checkpoint`); a file that cannot be
    read as one (truncated, malformed, not a checkpoint at all) is one ConfigRejected line naming
    it, not a traceback."""
    if model != "smollm2" and not Path(model).exists():
        raise ConfigRejected(f"{model}: no such file or directory", "model")
    try:
        return load_checkpoint(model, int8_dtype=int8_dtype)
    except ConfigRejected:
        raise
    except Exception as exc:  # any failure to parse a user's file is that file's fault
        said = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        what = "a readable GGUF file" if model.endswith(".gguf") else "a readable checkpoint"
        raise ConfigRejected(
            f"{model} is not {what} ({type(exc).__name__}{': ' + said if said else ''}); a model is 'smollm2', "
            "a GGUF file or a Hugging Face directory with config.json and safetensors",
            "model",
        ) from exc


# A GGUF's float model is taken to be this many times its file (4.5 bits a weight -> 32).
_FLOAT_PER_FILE_BYTE = 8


def _streams_int8(model: str, options: DriverOptions) -> bool:
    """Whether a GGUF's projections go straight into int8 (`gguf_stream`) rather than through a
    float model: for int8 weights, when w8a8 smoothing is off (it needs the float model), or when
    the float model would take more than half the memory available (then unsmoothed: said)."""
    path = smollm2_path() if model == "smollm2" else Path(model)
    if options.weights == "dense" or path.suffix != ".gguf" or not path.is_file():
        return False
    if options.weights == "int8" or not options.smooth:
        return True
    itemsize = torch.empty(0, dtype=DTYPES[options.dtype]).element_size()
    float_bytes = path.stat().st_size * _FLOAT_PER_FILE_BYTE * itemsize // 4
    available = _available_bytes()
    if float_bytes <= available // 2:
        return False
    print(
        f"[wafer torch] {model}: its float model would take about {float_bytes / 2**30:.1f} GiB of "
        f"{available / 2**30:.1f} GiB available, so its weights go straight into int8, unsmoothed",
        file=sys.stderr,
        flush=True,
    )
    return True


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: assume room enough (the float path, smoothed)


def _build(args: argparse.Namespace, options: DriverOptions, argv: list[str]) -> TorchDriver | TensorParallelDriver:
    streamed = args.tensor_parallel == 1 and _streams_int8(args.model, options)
    ckpt = _load(args.model, DTYPES[options.dtype] if streamed else None)
    if args.tensor_parallel == 1:
        return TorchDriver(ckpt, options)
    check_options(ckpt, options, args.tensor_parallel)  # before any rank starts
    group = start_group(args.tensor_parallel, args.device, argv, args.tp_timeout_s)
    driver = scatter_shards(ckpt, dataclasses.replace(options, device=rank_device(args.device, 0)), group)
    del ckpt
    group.barrier()  # every rank has built its shard: serve
    return TensorParallelDriver(driver, group)


def _follow(args: argparse.Namespace, options: DriverOptions) -> None:
    """Ranks 1..N-1 (started by rank 0): receive this rank's shard, build it, follow rank 0."""
    device = rank_device(args.device, args.tp_rank)
    group = join_group(args.tp_rank, args.tensor_parallel, device, args.tp_store, args.tp_parent, args.tp_timeout_s)
    shard = group.receive()
    assert isinstance(shard, Checkpoint)
    driver = build_rank_driver(shard, dataclasses.replace(options, device=device), group)
    del shard
    group.barrier()
    follow(driver, group)
    group.stop()


if __name__ == "__main__":
    main()
