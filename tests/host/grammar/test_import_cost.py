"""The grammar path imports jsonschema (over a second, with its format checkers) only for a
schema that has a `format` to check: a CLI run pays it only then."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import json, sys
from host.grammar import GrammarCompiler, TokenizerSpec
compiler = GrammarCompiler(TokenizerSpec.create("bytes", 260, [256], [257, 258, 259]), max_threads=1)
compiler.compile("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
compiler.compile("regex", "[a-z]+")
print("jsonschema" in sys.modules)
compiler.compile("json_schema", json.dumps({"type": "string", "format": "date"}))
print("jsonschema" in sys.modules)
"""


def test_jsonschema_is_imported_only_for_a_schema_with_a_format() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
