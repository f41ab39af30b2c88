"""Command line of the dummy driver: `python -m drivers.dummy --listen unix:PATH`, and
`create_driver(argv)` for hosts that run it in-process over a loopback connection."""

from __future__ import annotations

import argparse

from drivers.dummy.driver import DummyConfig, DummyDriver
from drivers.serve import add_serve_arguments, configure_logging, serve_forever


def build_parser(listen_required: bool = True) -> argparse.ArgumentParser:
    defaults = DummyConfig()
    parser = argparse.ArgumentParser(prog="python -m drivers.dummy", description="wafer's dummy driver")
    add_serve_arguments(parser, listen_required)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--page-size", type=int, default=defaults.page_size)
    parser.add_argument(
        "--min-page-size", type=int, default=defaults.min_page_size, help="resolve smaller page sizes up to this"
    )
    parser.add_argument("--num-pages", type=int, default=defaults.num_pages)
    parser.add_argument("--max-context", type=int, default=defaults.max_context)
    parser.add_argument("--max-requests-per-pass", type=int, default=defaults.max_requests_per_pass)
    parser.add_argument("--max-tokens-per-pass", type=int, default=defaults.max_tokens_per_pass)
    parser.add_argument(
        "--max-fill-chunk-tokens",
        type=int,
        default=defaults.max_fill_chunk_tokens,
        help="the largest chunk of one prompt per pass the handshake asks the host for (0: none)",
    )
    parser.add_argument("--pass-latency-ms", type=float, default=0.0, help="simulated time per pass")
    parser.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    parser.add_argument(
        "--say",
        default=None,
        metavar="TEXT",
        help="every context samples TEXT (its UTF-8 bytes, one token each) then end-of-text, instead of random tokens",
    )
    return parser


def create_driver(argv: list[str]) -> DummyDriver:
    """The driver these command-line arguments describe (used in-process by loopback)."""
    parser = build_parser(listen_required=False)
    args = parser.parse_args(argv)
    try:
        return DummyDriver(_config(args))
    except ValueError as exc:
        parser.error(str(exc))


def _config(args: argparse.Namespace) -> DummyConfig:
    return DummyConfig(
        vocab_size=args.vocab_size,
        page_size=args.page_size,
        min_page_size=args.min_page_size,
        num_pages=args.num_pages,
        max_context=args.max_context,
        max_requests_per_pass=args.max_requests_per_pass,
        max_tokens_per_pass=args.max_tokens_per_pass,
        max_fill_chunk_tokens=args.max_fill_chunk_tokens,
        pass_latency_ms=args.pass_latency_ms,
        seed=args.seed,
        script=tuple(args.say.encode("utf-8")) if args.say is not None else (),
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        driver = DummyDriver(_config(args))
    except ValueError as exc:
        parser.error(str(exc))
    serve_forever(driver, args.listen, args.max_frame_bytes)
