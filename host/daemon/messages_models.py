"""Request bodies of `POST /v1/messages` (the Anthropic Messages API), checked field by field:
text, tool_use and tool_result blocks, tools and tool_choice. Sampling fields the Messages API
does not define are the chat request's (host.daemon.chat_adapter), so they stay as extra fields.

Shapes only; turning them into a chat request is messages_routes' work.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag

from host.daemon.openai_models import MaxTokens, Name

MAX_MESSAGES = 2048
MAX_TOOLS = 128


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(_Strict):
    """A call the model made earlier, sent back as history."""

    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] | None = None
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(block.text for block in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def _text_or_blocks(value: Any) -> str:
    """Errors name the branch the value is on (a block's error, not "should be a string")."""
    return "Text" if isinstance(value, str) else "Blocks"


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: Annotated[
        Annotated[StrictStr, Tag("Text")] | Annotated[list[Block], Tag("Blocks")], Discriminator(_text_or_blocks)
    ]


class ToolParam(_Strict):
    name: Name
    input_schema: dict[str, Any]
    description: StrictStr | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: StrictStr | None = None  # accepted and ignored


class Metadata(_Strict):
    user_id: StrictStr | None = None


class MessagesRequest(BaseModel):
    # Extra fields are the chat request's sampling fields, or a 400 (chat_adapter.passed_through).
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: MaxTokens
    system: StrictStr | list[TextBlock] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: StrictFloat | None = None  # ranges: the chat request checks them
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    stream: StrictBool | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: they change nothing about generation here.
    metadata: Metadata | None = None
    service_tier: StrictStr | None = None
    thinking: ThinkingDisabled | None = None
    cache_control: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a message request whose `max_tokens` may be left out."""

    max_tokens: MaxTokens | None = None  # type: ignore[assignment]
