"""JSON grammars from xgrammar, with two defects of xgrammar 0.2.8 that we measured fixed.

- A string with minLength/maxLength is `[^"\\\r\n]{m,n}`: raw control characters (tab, U+0001)
  get through, which is invalid JSON. We refuse them (`[^"\\\0-\x1f]`). Escapes stay refused
  there: allowing them (an alternative inside the repetition) made masks take 40-750 ms a token.
- Free-form values (objects and arrays the schema does not describe, "any JSON") separate their
  elements with ", " whatever separators were asked for, so compact JSON such as `{"a":[1,2]}`
  is refused inside them. In compact mode we make that separator ",".

Both are rewrites of the grammar's EBNF text; the grammar is parsed again only when one applied.
"""

from __future__ import annotations

import xgrammar as xgr

_REWRITES = ((r"(([^\"\\\r\n]))", r"(([^\"\\\0-\x1f]))"),)
_COMPACT_REWRITES = (
    ('basic_array_items ::= ((", " basic_any))', 'basic_array_items ::= (("," basic_any))'),
    (
        'basic_object_properties ::= ((", " basic_string ":" basic_any))',
        'basic_object_properties ::= (("," basic_string ":" basic_any))',
    ),
)


def json_schema_grammar(schema: str, *, strict: bool, compact: bool) -> xgr.Grammar:
    """`schema` (JSON text) as an xgrammar Grammar; compact: no whitespace outside strings."""
    if compact:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=strict)
    else:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=True, strict_mode=strict)
    text = original = str(grammar)
    for old, new in _REWRITES + (_COMPACT_REWRITES if compact else ()):
        text = text.replace(old, new)
    return grammar if text == original else xgr.Grammar.from_ebnf(text)
