"""Request bodies of `POST /v1/responses` (the OpenAI Responses API), checked field by field:
input items, function tools, text formats. Sampling fields the Responses API does not define
are the chat request's (host.daemon.chat_adapter), so they stay as extra fields here.

Shapes only; turning them into a chat request is responses_routes' work.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictStr,
    Tag,
)

from host.daemon.openai_models import MaxTokens, Name

MAX_INPUT_ITEMS = 2048
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Strict):
    """An earlier answer's text, sent back as history."""

    type: Literal["output_text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: StrictStr


ContentPart = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


def _text_or_list(value: Any) -> str:
    """Errors name the branch the value is on (a list item's error, not "should be a string")."""
    return "Text" if isinstance(value, str) else "List"


Content = Annotated[
    Annotated[StrictStr, Tag("Text")] | Annotated[list[ContentPart], Tag("List")], Discriminator(_text_or_list)
]


class InputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.refusal if isinstance(part, Refusal) else part.text for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made earlier, sent back as history."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_kind(value: Any) -> str:
    """An item without `type` is a message (the API's "easy input message")."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}.get(
        kind or "message", str(kind)
    )


InputItem = Annotated[
    Annotated[InputMessage, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_kind),
]


Input = Annotated[
    Annotated[StrictStr, Tag("Text")]
    | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS), Tag("List")],
    Discriminator(_text_or_list),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Name
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: StrictStr


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: Name
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    # Extra fields are the chat request's sampling fields, or a 400 (chat_adapter.passed_through).
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    input: Input
    instructions: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: StrictFloat | None = None  # ranges: the chat request checks them
    top_p: StrictFloat | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    # Accepted and ignored: they change nothing about generation here.
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    truncation: Literal["disabled", "auto"] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    background: StrictBool | None = None
