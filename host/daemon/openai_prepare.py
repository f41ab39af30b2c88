"""Turn a validated OpenAI request into a chat-inferlet job, refusing (400/404) everything that
cannot be served before any generation starts: unknown model, unsupported or inconsistent
fields, invalid schemas or tool names, prompts longer than the context.

Runs on a worker thread (it tokenizes); knows the model and tokenizer, not HTTP.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError

from host.daemon.errors import BadRequest, NotFound
from host.daemon.openai_models import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
)
from host.engine.pass_check import MAX_LOGIT_BIAS
from host.errors import FeatureUnavailable, HostError
from host.services import ModelInfo, Tokenizer

if TYPE_CHECKING:
    from host.grammar import GrammarCompiler

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy endpoint's documented default
# The engine's grammar compiler, built on first use (importing xgrammar takes a second or two).
GrammarSource = Callable[[], "GrammarCompiler"]

# Every string maxLength is enforced. Measured with SmolLM2's tokenizer: a bound above 32 costs
# 0.2-1.5 s to compile (flat from about 255 up, so a huge bound is no denial of service), once
# per schema (compiled grammars are cached by text); refusing them turned away real schemas.
ENFORCE_EVERY_MAX_LENGTH = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Job:
    """What the chat inferlet is asked to do, and what the response needs to know."""

    args: dict[str, Any]  # the chat inferlet's JSON argument
    num_prompts: int
    n: int
    prompt_tokens: int  # over all prompts, each counted once (forks share it)
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    tool_call: str = ""  # "" (text), "forced" (the output is one call) or "auto" (text, calls in markers)
    echo: tuple[str, ...] = ()  # completions with echo: each prompt's text, which its choices start with
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise NotFound(
            f"The model '{requested}' does not exist; this server serves '{served}'",
            param="model",
            code="model_not_found",
        )


def prepare_chat(
    req: ChatCompletionRequest,
    model: ModelInfo,
    tokenizer: Tokenizer,
    grammars: GrammarSource,
    *,
    json_object_requires_json_word: bool = False,
    owner: str | None = None,
) -> Job:
    """`owner`: the API key's id, whose compiles get at most their share of the compile
    workers (host.grammar.GrammarCompiler.compile)."""
    grammar = _check_response_format(req, json_object_requires_json_word)
    tools_grammar, tool_call = _check_tools(req)
    if grammar is not None and tools_grammar is not None:
        raise BadRequest("response_format and tools cannot both constrain the output; use one", param="response_format")
    grammar = grammar or tools_grammar
    if grammar is not None:
        _compile(grammars, grammar, owner)
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise BadRequest(
            "max_tokens and max_completion_tokens disagree; set only max_completion_tokens",
            param="max_completion_tokens",
        )
    messages = [[_template_role(m.role), _message_text(m)] for m in req.messages]
    try:
        text = tokenizer.apply_chat_template([(r, c) for r, c in messages], True)
        prompt = tokenizer.encode(text)
    except HostError as exc:
        raise BadRequest(f"the messages cannot be rendered: {exc}", param="messages") from None
    limit = req.max_completion_tokens or req.max_tokens
    max_tokens = _fit_context(len(prompt), limit, model.kept_context, "messages")
    _fit_choices([len(prompt)], req.n or 1, model, "messages")
    top = req.top_logprobs or 0
    # The rendered prompt as token ids: the chat inferlet need not render and tokenize it again.
    job = _job(req, model, tokenizer, [{"tokens": prompt}], len(prompt), max_tokens, bool(req.logprobs), top)
    if grammar is not None:
        job.args["grammar"] = grammar
    return replace(job, tool_call=tool_call) if tool_call else job


def prepare_completion(
    req: CompletionRequest,
    model: ModelInfo,
    tokenizer: Tokenizer,
    grammars: GrammarSource,
    max_prompts: int = MAX_PROMPTS,
    max_choices: int = MAX_CHOICES,
) -> Job:
    """The chat inferlet's job for a completions request of at most `max_prompts` prompts and
    `max_choices` choices (the daemon's `completions_max_*`)."""
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix", code="unsupported_parameter")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise BadRequest("best_of other than n is not supported", param="best_of", code="unsupported_parameter")
    raw_prompts = _prompt_list(req.prompt)
    if len(raw_prompts) > max_prompts:
        raise BadRequest(
            f"{len(raw_prompts)} prompts, past the {max_prompts} one request may have: send fewer prompts per request",
            param="prompt",
        )
    if len(raw_prompts) * n > max_choices:
        raise BadRequest(
            f"{len(raw_prompts)} prompts with n={n} ask for {len(raw_prompts) * n} choices, past the "
            f"{max_choices} one request may have: send fewer prompts per request",
            param="n" if n > 1 else "prompt",
        )
    prompts: list[dict[str, Any]] = []
    counts: list[int] = []
    echo: list[str] = []
    for raw in raw_prompts:
        if isinstance(raw, str):
            tokens = tokenizer.encode(raw)
            prompts.append({"tokens": tokens})  # tokenized once, here
            echo.append(raw)
        else:
            bad = [t for t in raw if t >= model.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} is outside the vocabulary of {model.vocab_size}", param="prompt")
            tokens = raw
            prompts.append({"tokens": raw})
            echo.append(tokenizer.decode(raw) if req.echo else "")
        if not tokens:
            raise BadRequest("the prompt is empty", param="prompt")
        counts.append(len(tokens))
    limit = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = _fit_context(max(counts), limit, model.kept_context, "prompt")
    _fit_choices(counts, n, model, "prompt")
    logprobs = req.logprobs is not None
    job = _job(req, model, tokenizer, prompts, sum(counts), max_tokens, logprobs, req.logprobs or 0)
    if not req.echo:
        return job
    if logprobs:
        job.args["echo_logprobs"] = True  # each prompt token's logprob, from the prompt's own pass
    return replace(job, echo=tuple(echo))


def _job(
    req: ChatCompletionRequest | CompletionRequest,
    model: ModelInfo,
    tokenizer: Tokenizer,
    prompts: list[dict[str, Any]],
    prompt_tokens: int,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
) -> Job:
    n = req.n or 1
    args: dict[str, Any] = {
        "prompts": prompts,
        "n": n,
        "max_tokens": max_tokens,
        "stop": req.stop_list(),
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    if req.seed is not None:
        args["seed"] = req.seed
    args.update(_sampler_stages(req, model.vocab_size))
    if req.dry_multiplier and req.dry_penalty_last_n != 0:
        args["dry"] = _dry_args(req, tokenizer, model.vocab_size)
    if req.ignore_eos:
        args["ignore_eos"] = True
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    job = Job(args, len(prompts), n, prompt_tokens, logprobs, top_logprobs, bool(req.stream), include_usage)
    return replace(job, tokens_as_ids=True) if req.return_tokens_as_token_ids else job


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _fit_choices(prompt_lengths: list[int], n: int, model: ModelInfo, param: str) -> None:
    """A 400 for `n` choices of each prompt whose forks alone would take the run past its share
    of the KV pages (run_max_pages_fraction): a fork is charged its parent's pages and a copy of
    the partial one (host.engine.contexts), so such a request could only fail after its prompts
    were computed."""
    if n < 2 or not model.run_max_tokens:
        return
    page_size = model.page_size
    run_pages = model.run_max_tokens // page_size
    needed = sum(-(-length // page_size) * n + (n - 1) for length in prompt_lengths)
    if needed > run_pages:
        raise BadRequest(
            f"n={n} choices of {sum(prompt_lengths)} prompt tokens need at least {needed} KV pages of "
            f"{page_size} tokens (each choice holds its prompt's pages), past the {run_pages} one request "
            "may hold (run_max_pages_fraction); lower n or shorten the prompt",
            param="n",
            code="context_length_exceeded",
        )


def _fit_context(num_prompt: int, limit: int | None, max_context: int, param: str) -> int:
    """The completion budget: `limit` if prompt + limit fits the context, else a 400."""
    if limit is None:
        if num_prompt >= max_context:
            raise BadRequest(
                f"This model's maximum context length is {max_context} tokens. However, your {param} "
                f"resulted in {num_prompt} tokens, which leaves no room for a completion.",
                param=param,
                code="context_length_exceeded",
            )
        return max_context - num_prompt
    if num_prompt + limit > max_context:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{num_prompt + limit} tokens ({num_prompt} in the {param}, {limit} in the completion). "
            f"Please reduce the length of the {param} or the completion.",
            param=param,
            code="context_length_exceeded",
        )
    return limit


def _template_role(role: str) -> str:
    return "system" if role == "developer" else role


def _message_text(message: Any) -> str:
    text: str = message.text()
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        text += json.dumps({"tool_calls": calls})
    return text


def _sampler_stages(req: ChatCompletionRequest | CompletionRequest, vocab_size: int) -> dict[str, Any]:
    """The chat inferlet's arguments for the sampler chain: OpenAI's penalties and logit bias
    (token ids checked against the vocabulary, as vLLM does), vLLM's repetition_penalty, top_k
    (-1 or 0: off) and min_p, llama.cpp's repeat_penalty (the same) and repeat_last_n, typical_p,
    top_n_sigma, xtc_probability / xtc_threshold and mirostat (2) / mirostat_tau / mirostat_eta.
    Only the ones that change the sampler."""
    args: dict[str, Any] = {}
    if req.frequency_penalty:
        args["frequency_penalty"] = req.frequency_penalty
    if req.presence_penalty:
        args["presence_penalty"] = req.presence_penalty
    repetition = req.repetition_penalty if req.repetition_penalty is not None else req.repeat_penalty
    if req.repeat_penalty is not None and req.repeat_penalty != repetition:
        raise BadRequest("repeat_penalty and repetition_penalty name one penalty: give one", param="repeat_penalty")
    if repetition is not None and repetition != 1:
        args["repetition_penalty"] = repetition
    if req.repeat_last_n == 0:  # llama.cpp: 0 turns the penalties off
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            args.pop(name, None)
    elif req.repeat_last_n is not None and req.repeat_last_n > 0:
        args["penalty_last_n"] = req.repeat_last_n
    if req.top_k is not None and req.top_k > 0:
        args["top_k"] = req.top_k
    if req.min_p:
        args["min_p"] = req.min_p
    if req.typical_p is not None and req.typical_p != 1:
        args["typical_p"] = req.typical_p
    if req.top_n_sigma:
        args["top_n_sigma"] = req.top_n_sigma
    if req.xtc_probability:
        args["xtc_probability"] = req.xtc_probability
        args["xtc_threshold"] = 0.1 if req.xtc_threshold is None else req.xtc_threshold
    if req.mirostat == 2:
        args["mirostat_tau"] = 5.0 if req.mirostat_tau is None else req.mirostat_tau
        args["mirostat_eta"] = 0.1 if req.mirostat_eta is None else req.mirostat_eta
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS:
            raise BadRequest(
                f"logit_bias has {len(req.logit_bias)} tokens, past the {MAX_LOGIT_BIAS} one request may bias",
                param="logit_bias",
            )
        bias: dict[str, float] = {}
        for key, value in req.logit_bias.items():
            token = int(key) if key.strip().isdigit() else -1
            if not 0 <= token < vocab_size:
                raise BadRequest(
                    f"logit_bias: token id {key!r} is not in the vocabulary [0, {vocab_size})", param="logit_bias"
                )
            bias[str(token)] = float(value)
        args["logit_bias"] = bias
    return args


# llama.cpp's default DRY sequence breakers.
DRY_BREAKERS = ("\n", ":", '"', "*")


def _dry_args(req: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """llama.cpp's DRY parameters as the chat inferlet's `dry` argument: its defaults where a
    parameter is absent, and each sequence breaker turned into the tokens whose text holds it."""
    breakers = DRY_BREAKERS if req.dry_sequence_breakers is None else tuple(req.dry_sequence_breakers)
    last_n = req.dry_penalty_last_n
    return {
        "multiplier": float(req.dry_multiplier or 0.0),
        "base": 1.75 if req.dry_base is None else float(req.dry_base),
        "allowed_length": 2 if req.dry_allowed_length is None else req.dry_allowed_length,
        "last_n": 0 if last_n is None or last_n < 0 else last_n,
        "breakers": breaker_tokens(tokenizer, vocab_size, breakers),
    }


_token_texts: dict[int, tuple[Any, list[str]]] = {}  # id(tokenizer) -> (tokenizer, each token's text)
_token_texts_lock = threading.Lock()


def breaker_tokens(tokenizer: Tokenizer, vocab_size: int, breakers: tuple[str, ...]) -> list[int]:
    """The tokens whose text holds one of `breakers` (each token decoded once per tokenizer)."""
    with _token_texts_lock:
        held = _token_texts.get(id(tokenizer))
        if held is None or held[0] is not tokenizer:
            texts = [tokenizer.decode([i]) for i in range(vocab_size)]
            _token_texts.clear()  # one model at a time: the last tokenizer's texts only
            held = _token_texts[id(tokenizer)] = (tokenizer, texts)
    return [i for i, text in enumerate(held[1]) if any(b in text for b in breakers)]


def _check_schema(schema: dict[str, Any], param: str) -> None:
    """Checked against the draft the schema declares in `$schema` (2020-12 when it declares none):
    a draft-04 tuple `items` or boolean `exclusiveMinimum` is valid there."""
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise BadRequest(
            f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}", param=param, code="invalid_schema"
        ) from None


def _check_response_format(req: ChatCompletionRequest, requires_json_word: bool) -> dict[str, Any] | None:
    """The grammar the response must follow (for the chat inferlet), or None for text."""
    fmt = req.response_format
    if isinstance(fmt, JsonSchemaResponseFormat):
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {}
        _check_schema(schema, "response_format.json_schema.schema")
        # `strict: true` is OpenAI's strict mode (properties the schema does not declare are
        # refused); otherwise JSON Schema's own semantics. Either way a keyword no engine would
        # enforce is a 400 naming it: "stop" must mean the content validates.
        options = {
            "strict": bool(fmt.json_schema.strict),
            "reject_unsupported": True,
            "max_length_limit": ENFORCE_EVERY_MAX_LENGTH,
        }
        return {"kind": "json-schema", "text": json.dumps(schema), "options": options}
    if isinstance(fmt, JsonObjectFormat):
        if requires_json_word and not any("json" in _message_text(m).lower() for m in req.messages):
            # The OpenAI API insists on this, so that the model is told to write JSON.
            raise BadRequest(
                "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'",
                param="messages",
            )
        return {"kind": "json-object", "text": "", "options": {}}
    return None


def _compile(grammars: GrammarSource, grammar: dict[str, Any], owner: str | None) -> None:
    """Compile now (it is cached for the chat inferlet's own compile): a schema the grammar
    engine refuses is a 400 before any generation starts."""
    param = "tools" if grammar["kind"] == "tool-call" else "response_format"
    try:
        grammars().compile(grammar["kind"].replace("-", "_"), grammar["text"], grammar["options"], owner=owner)
    except FeatureUnavailable as exc:
        raise BadRequest(str(exc), param=param, code="grammar_unavailable") from None
    except HostError as exc:
        raise BadRequest(f"the JSON schema cannot be enforced: {exc}", param=param, code="invalid_schema") from None


def _check_tools(req: ChatCompletionRequest) -> tuple[dict[str, Any] | None, str]:
    """The tool-call grammar and mode ("forced" or "auto"), or (None, "") for plain text."""
    if req.tools is not None and not req.tools:
        raise BadRequest("tools must name at least one function (or be left out)", param="tools")
    if not req.tools:
        return None, ""
    names = set()
    for i, tool in enumerate(req.tools):
        if tool.function.name in names:
            raise BadRequest(f"duplicate tool name {tool.function.name!r}", param=f"tools[{i}].function.name")
        names.add(tool.function.name)
        if tool.function.parameters is not None:
            _check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise BadRequest(
            f"tool_choice names function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
        )
    if choice == "none":
        return None, ""
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]
    if isinstance(choice, NamedToolChoice):
        mode, grammar_choice = "forced", choice.function.name
    elif choice == "required":
        mode, grammar_choice = "forced", "required"
    else:  # "auto", the default when tools are given
        mode, grammar_choice = "auto", "auto"
    options = {
        "choice": grammar_choice,
        "strict": True,
        "reject_unsupported": True,
        "max_length_limit": ENFORCE_EVERY_MAX_LENGTH,
    }
    return {"kind": "tool-call", "text": json.dumps(tools), "options": options}, mode
