"""The wafer inferlet SDK: write `def main(args: list[str]) -> None` in your inferlet's `app.py`
and drive generation with `Context`.

    from inferlet import Context, Greedy, emit

    def main(args: list[str]) -> None:
        ctx = Context()
        ctx.fill("Hello")
        for text in ctx.generate_text(max_tokens=16):
            emit(text)

Your modules are imported when a run starts; they may import each other, the SDK and the
standard modules in wafer's base (docs/writing-inferlets.md says which; `wafer build` makes a
snapshot build for an inferlet that needs others).
"""

from inferlet.adapter import Adapter, AdapterError
from inferlet.arguments import ArgumentParser
from inferlet.attention import LogitMask, Window
from inferlet.chat_model import ChatRequest, chat_model
from inferlet.context import (
    Completion,
    Context,
    InferenceError,
    TokenChoice,
    decode_steps,
    decode_steps_with_logprobs,
    execute_together,
    pages_in_use,
    top_k_all,
)
from inferlet.errors import InferletError
from inferlet.grammar import Grammar, GrammarError, Matcher
from inferlet.model import ChatMessage, ModelInfo, detokenize, model_info, render_chat, tokenize
from inferlet.runtime import args, emit, log, receive, run_id, send
from inferlet.sampling import (
    DRY,
    XTC,
    Chain,
    Greedy,
    LogitBias,
    MinP,
    Mirostat,
    Penalties,
    Random,
    Sampler,
    Temperature,
    TopK,
    TopNSigma,
    TopP,
    Typical,
)
from inferlet.text import TextDecoder

__all__ = [
    "DRY",
    "XTC",
    "Adapter",
    "AdapterError",
    "ArgumentParser",
    "Chain",
    "ChatMessage",
    "ChatRequest",
    "Completion",
    "Context",
    "Grammar",
    "GrammarError",
    "Greedy",
    "InferenceError",
    "InferletError",
    "LogitBias",
    "LogitMask",
    "Matcher",
    "MinP",
    "Mirostat",
    "ModelInfo",
    "Penalties",
    "Random",
    "Sampler",
    "Temperature",
    "TextDecoder",
    "TokenChoice",
    "TopK",
    "TopNSigma",
    "TopP",
    "Typical",
    "Window",
    "args",
    "chat_model",
    "decode_steps",
    "decode_steps_with_logprobs",
    "detokenize",
    "emit",
    "execute_together",
    "log",
    "model_info",
    "pages_in_use",
    "receive",
    "render_chat",
    "run_id",
    "send",
    "tokenize",
    "top_k_all",
]
