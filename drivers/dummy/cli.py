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
    parser.add_argument(
        "--logits",
        type=_logits,
        default=(),
        metavar="TOKEN=LOGIT,...",
        help="the model's logits at every row (other tokens 0): rows sample from them, after their sampler "
        "chain, as the torch driver would (e.g. 'h=3,i=2.5,33=1': a one-character text or a token id)",
    )
    return parser


def _logits(text: str) -> tuple[tuple[int, float], ...]:
    """TOKEN=LOGIT pairs; a TOKEN of one character is its byte token, else a token id."""
    pairs: dict[int, float] = {}
    for item in filter(None, text.split(",")):
        token, sep, value = item.rpartition("=")
        if not sep or not token:
            raise argparse.ArgumentTypeError(f"{item!r} is not TOKEN=LOGIT")
        encoded = token.encode("utf-8")
        try:
            pairs[encoded[0] if len(encoded) == 1 else int(token)] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: TOKEN is one character or a token id, LOGIT a number"
            ) from None
    return tuple(sorted(pairs.items()))


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
        logits=args.logits,
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
