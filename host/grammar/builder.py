"""Builds one grammar from its key for one tokenizer: which engine compiles a JSON schema or a
tool call, the schema as both engines get it, and an engine's errors as the kind's typed error.

Knows the engines (xgrammar, llguidance via llg_backend); not caching, threads or budgets.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import xgrammar as xgr

from host.grammar import llg_backend, schema_support, tool_call
from host.grammar.errors import InvalidGrammar, InvalidJSONSchema, InvalidToolCall, UnsupportedSchema
from host.grammar.grammar import Grammar, GrammarKey
from host.grammar.json_grammar import json_schema_grammar
from host.grammar.limits import MAX_SCHEMA_DEPTH, check_schema_size
from host.grammar.options import ERRORS, Option
from host.grammar.schema_coverage import outside_refs, unsupported_features
from host.grammar.schema_one_of import exclusive_one_of_as_any_of
from host.grammar.tokenizer_info import TokenizerSpec, token_table, tokenizer_info
from host.grammar.utf8_guard import Utf8Guard

# Which engine compiles a JSON schema (options.BACKENDS). "auto": xgrammar when it enforces every
# keyword and its compile is cheap (strict mode, no string bound above XGRAMMAR_CHEAP_MAX_LENGTH),
# else llguidance; when llguidance refuses, xgrammar after all (it may then be slow, or leave
# keywords unenforced). Measured on the 133-schema corpus with SmolLM2: xgrammar's non-strict
# compiles took over a second for 30 schemas (up to 48 s), llguidance's 17 ms at most.
XGRAMMAR_CHEAP_MAX_LENGTH = 32
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed check.
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

Compiled = xgr.CompiledGrammar | llg_backend.CompiledLLG


class GrammarBuilder:
    """One per tokenizer; `build` is thread-safe (xgrammar's compiler is) and may take seconds."""

    def __init__(self, tokenizer: TokenizerSpec, *, max_threads: int) -> None:
        self.tokenizer = tokenizer
        info = tokenizer_info(tokenizer)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._utf8_guard = Utf8Guard.from_table(token_table(tokenizer))

    def build(self, key: GrammarKey) -> Grammar:
        """Compile `key` (its options already checked), timed; raises the kind's InvalidGrammar."""
        options = dict(key.options)
        start = time.perf_counter()
        unsupported: tuple[str, ...] = ()
        compiled: Compiled
        try:
            if key.kind == "json_schema":
                compiled, unsupported = self._json_schema(key.text, options)
            elif key.kind in ("json_object", "json"):
                schema = '{"type":"object"}' if key.kind == "json_object" else "{}"
                compiled = self._compile_json(schema, strict=False, compact=bool(options["compact"]))
            elif key.kind == "regex":
                compiled = self._compiler.compile_regex(key.text)
            elif key.kind == "ebnf":
                compiled = self._compiler.compile_grammar(key.text, root_rule_name=str(options["root"]))
            else:
                compiled, unsupported = self._tool_call(key.text, options)
        except InvalidGrammar:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors alike
            raise ERRORS[key.kind](_engine_message(exc)) from None
        return self._grammar(key, compiled, unsupported, time.perf_counter() - start)

    @staticmethod
    def portable(grammar: Grammar) -> str | None:
        """What another process rebuilds `grammar` from cheaply: llguidance's checked grammar
        text. None for xgrammar's, which is compiled again there instead: its only portable
        form (JSON) takes longer to write and read than the compile (147 MB and 16 s for a
        3 MB grammar that compiles in 7 s, measured)."""
        return grammar.compiled.grammar if isinstance(grammar.compiled, llg_backend.CompiledLLG) else None

    def rebuild(self, key: GrammarKey, text: str, unsupported: tuple[str, ...], compile_time_s: float) -> Grammar:
        """The llguidance grammar `portable` gave, for a builder of the same tokenizer."""
        tokenizer = llg_backend.tokenizer(self.tokenizer)
        compiled = llg_backend.CompiledLLG(tokenizer, text, self.tokenizer.stop_token_ids)
        return self._grammar(key, compiled, unsupported, compile_time_s)

    def _grammar(self, key: GrammarKey, compiled: Compiled, unsupported: tuple[str, ...], time_s: float) -> Grammar:
        return Grammar(
            key,
            compiled,
            self.tokenizer.vocab_size,
            self.tokenizer.stop_token_ids,
            unsupported,
            time_s,
            self._utf8_guard,
            llg_backend.BACKEND if isinstance(compiled, llg_backend.CompiledLLG) else "xgrammar",
        )

    def _compile_json(self, schema: str, *, strict: bool, compact: bool) -> xgr.CompiledGrammar:
        return self._compiler.compile_grammar(json_schema_grammar(schema, strict=strict, compact=compact))

    def _json_schema(self, text: str, options: dict[str, Option]) -> tuple[Compiled, tuple[str, ...]]:
        backend = str(options["backend"])
        strict, compact = bool(options["strict"]), bool(options["compact"])
        schema, features = _prepared(_parse_schema(text, InvalidJSONSchema), strict)
        if backend == "auto" and strict and _cheap(schema, features):
            return self._compile_json(json.dumps(schema, ensure_ascii=False), strict=True, compact=compact), ()
        refusal = ""
        if backend in ("auto", "llguidance"):
            try:
                closed = schema_support.close_objects(schema) if strict else schema
                return llg_backend.compile_json_schema(self.tokenizer, closed, compact=compact), ()
            except llg_backend.Refused as exc:
                if backend == "llguidance":
                    raise UnsupportedSchema((), str(exc)) from None
                refusal = str(exc)
        if outside := outside_refs(features):
            raise UnsupportedSchema(outside, refusal)
        schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
        unsupported = tuple(sorted(features + relaxed))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(unsupported, refusal)
        normalized = json.dumps(schema, ensure_ascii=False)
        return self._compile_json(normalized, strict=strict, compact=compact), unsupported

    def _tool_call(self, text: str, options: dict[str, Option]) -> tuple[Compiled, tuple[str, ...]]:
        chosen = tool_call.select(tool_call.parse_tools(text), str(options["choice"]))
        strict, backend, choice = bool(options["strict"]), str(options["backend"]), str(options["choice"])
        prepared: list[tuple[tool_call.Tool, Any, tuple[str, ...]]] = []
        for tool in chosen:
            check_schema_size(tool.parameters, InvalidToolCall)
            schema, features = _prepared(schema_support.normalize(tool.parameters), strict)
            prepared.append((tool, schema, features))
        # Free text with calls in it ("auto") is xgrammar's structural tag; llguidance serves
        # forced and required calls, where xgrammar would leave a keyword unenforced or be slow.
        refusal = ""
        if backend == "llguidance" and choice == "auto":
            raise InvalidToolCall("llguidance serves forced and required calls; choice 'auto' needs xgrammar")
        all_cheap = all(_cheap(schema, features) for _, schema, features in prepared)
        if backend == "llguidance" or (backend == "auto" and choice != "auto" and not all_cheap):
            calls = [(t.name, schema_support.close_objects(schema) if strict else schema) for t, schema, _ in prepared]
            try:
                return llg_backend.compile_tool_calls(self.tokenizer, calls), ()
            except llg_backend.Refused as exc:
                if backend == "llguidance":
                    raise UnsupportedSchema((), str(exc)) from None
                refusal = str(exc)
        outside = [f"{f} in tool {tool.name!r}" for tool, _, features in prepared for f in outside_refs(features)]
        if outside:
            raise UnsupportedSchema(tuple(outside), refusal)
        arguments: list[xgr.Grammar] = []
        unsupported: list[str] = []
        for tool, schema, features in prepared:
            schema, relaxed = schema_support.relax_max_length(schema, int(options["max_length_limit"]))
            unsupported += [f"{f} in tool {tool.name!r}" for f in features + relaxed]
            arguments.append(json_schema_grammar(json.dumps(schema, ensure_ascii=False), strict=strict, compact=True))
        if unsupported and options["reject_unsupported"]:
            raise UnsupportedSchema(tuple(unsupported), refusal)
        if choice == "auto":
            tag = tool_call.auto_structural_tag(chosen, arguments, str(options["call_begin"]), str(options["call_end"]))
            return self._compiler.compile_structural_tag(tag), tuple(unsupported)
        calls_ = [tool_call.call_grammar(tool, args) for tool, args in zip(chosen, arguments, strict=True)]
        return self._compiler.compile_grammar(tool_call.required_grammar(calls_)), tuple(unsupported)


def _prepared(schema: Any, strict: bool) -> tuple[Any, tuple[str, ...]]:
    """A normalized schema as both engines get it (formats no validator checks dropped, oneOf
    proved exclusive as anyOf), and what xgrammar would not enforce, in the schema's own words."""
    if schema_support.has_format(schema):  # (only then is jsonschema, slow to import, needed)
        schema, _annotations = schema_support.drop_annotation_formats(schema, schema_support.checked_formats(schema))
    features = unsupported_features(schema, strict)
    return exclusive_one_of_as_any_of(schema), features


def _cheap(schema: Any, features: tuple[str, ...]) -> bool:
    """xgrammar enforces all of `schema` and compiles it quickly (no long maxLength)."""
    return not features and not schema_support.relax_max_length(schema, XGRAMMAR_CHEAP_MAX_LENGTH)[1]


def _parse_schema(text: str, error: Callable[[str], InvalidGrammar]) -> Any:
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise error(f"the schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise error(f"the schema nests deeper than the {MAX_SCHEMA_DEPTH} levels this host compiles") from None
    if not isinstance(schema, dict | bool):
        raise error(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    check_schema_size(schema, error)
    return schema_support.normalize(schema)


def _engine_message(exc: Exception) -> str:
    lines = [_ENGINE_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    message = " ".join(line for line in lines if line) or type(exc).__name__
    return message if len(message) <= 500 else message[:497] + "..."
