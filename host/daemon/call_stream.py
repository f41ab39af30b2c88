"""A forced tool call's arguments as they are generated, for the APIs that stream them (Responses'
`function_call_arguments.delta`, Messages' `input_json_delta`): the grammar writes the call as
`{"name":...,"arguments":ARGS}`, so ARGS can be sent while it grows, holding back its last
character, which may be the call's own closing brace.

Pure: it sees the choice's text and how it finished.
"""

from __future__ import annotations

from host.daemon.openai_render import forced_call


class CallArguments:
    def __init__(self) -> None:
        self.name: str | None = None  # known once the call's name is complete
        self.text = ""  # the arguments sent so far; all of them once the choice finished
        self._arguments = ""

    def advance(self, call_text: str, finish: str | None) -> str:
        """What to send of the arguments now ("" for nothing new), given the choice's whole
        text and its finish reason (None while generating). A call cut by max_tokens
        ("length") has no closing brace of its own: all its text is arguments."""
        call = forced_call(call_text)
        if call is None:
            return ""
        self.name, arguments = call
        end = len(arguments) if finish == "length" else len(arguments) - 1
        delta = arguments[len(self.text) : end]
        self.text += delta
        return delta


def final_arguments(call_text: str, finish: str | None) -> tuple[str, str] | None:
    """A finished forced call's name and arguments (as `CallArguments` streams them), or None
    when it was cut inside its name."""
    stream = CallArguments()
    stream.advance(call_text, finish)
    return None if stream.name is None else (stream.name, stream.text)
