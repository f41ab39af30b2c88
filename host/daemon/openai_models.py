"""Request bodies of the OpenAI-compatible endpoints, checked field by field as the OpenAI API
reference defines them (types are strict: a string is never taken for a number).

Shapes only; rules that need the model (context length, vocabulary) live in `openai_prepare.py`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

MAX_N = 128
# One completions request is one run: its prompts and their choices are its contexts. A list of
# 20,000 prompts held every tenant back for the whole run budget.
MAX_PROMPTS = 128
MAX_CHOICES = 256  # prompts x n
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Temperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0)]
TopP = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
Seed = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
NumChoices = Annotated[StrictInt, Field(ge=1, le=MAX_N)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Stop = StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_STOP)]
LogitBias = dict[StrictStr, Annotated[StrictInt | StrictFloat, Field(ge=-100, le=100)]]
# vLLM's extensions: > 0 (1 = off); -1 or 0 = off; [0, 1).
RepetitionPenalty = Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=100.0)]
TopK = Annotated[StrictInt, Field(ge=-1)]
MinP = Annotated[StrictFloat | StrictInt, Field(ge=0.0, lt=1.0)]
Name = Annotated[StrictStr, Field(pattern=NAME_PATTERN)]


class _Strict(BaseModel):
    # Unknown fields are refused, as the OpenAI API does ("Unrecognized request argument").
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    refusal: StrictStr | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(_Strict):
    name: Name
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: Name
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class _Sampling(_Strict):
    """Fields the chat and legacy completion requests share."""

    model: StrictStr
    n: NumChoices | None = None
    stop: Stop | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    # vLLM's sampling extensions (SGLang and llama.cpp's server take them too).
    repetition_penalty: RepetitionPenalty | None = None
    # llama.cpp's server's names: repeat_penalty is repetition_penalty; repeat_last_n limits every
    # penalty to the last n tokens (-1: the whole context, 0: penalties off).
    repeat_penalty: RepetitionPenalty | None = None
    repeat_last_n: Annotated[StrictInt, Field(ge=-1, le=1_000_000)] | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    # vLLM's: logprobs name each token "token_id:N" (for tokens whose text does not round-trip).
    return_tokens_as_token_ids: StrictBool | None = None
    # llama.cpp's server's filters.
    typical_p: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=1.0)] | None = None
    top_n_sigma: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=100.0)] | None = None
    xtc_probability: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=1.0)] | None = None
    xtc_threshold: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=1.0)] | None = None
    mirostat: Literal[0, 2] | None = None  # llama.cpp's: 0 off, 2 Mirostat 2 (1 is not served)
    mirostat_tau: Annotated[StrictFloat | StrictInt, Field(gt=0.0, le=100.0)] | None = None
    mirostat_eta: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=1.0)] | None = None
    # llama.cpp's server's DRY: dry_penalty_last_n -1 looks at the whole context, 0 turns it off.
    dry_multiplier: Annotated[StrictFloat | StrictInt, Field(ge=0.0, le=100.0)] | None = None
    dry_base: Annotated[StrictFloat | StrictInt, Field(ge=1.0, le=100.0)] | None = None
    dry_allowed_length: Annotated[StrictInt, Field(ge=0, le=1_000_000)] | None = None
    dry_penalty_last_n: Annotated[StrictInt, Field(ge=-1, le=1_000_000)] | None = None
    dry_sequence_breakers: (
        Annotated[list[Annotated[StrictStr, Field(min_length=1, max_length=32)]], Field(max_length=16)] | None
    ) = None
    user: StrictStr | None = None
    # An extension (as in vLLM and llama.cpp's server): generate through the model's stop
    # tokens, up to max_tokens (stop strings and grammars still end a choice). For benchmarks.
    ignore_eos: StrictBool | None = None

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # Accepted and ignored: they change nothing about generation here.
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice is only allowed when tools are specified")
        return self


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Prompt = (
    StrictStr
    | Annotated[list[StrictStr], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: MaxTokens | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=20)] | None = None
