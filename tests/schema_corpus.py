"""The vendored JSON-schema corpus (tests/data/jsonschemas, from shared/data): its schemas in
index order, and a validator of the draft each schema declares. Shared by the end-to-end and
HTTP corpus tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema

CORPUS = Path(__file__).resolve().parent / "data" / "jsonschemas"


def corpus_schemas() -> list[Path]:
    """Every schema of the corpus (133), in its index's order."""
    lines = (CORPUS / "index.tsv").read_text().splitlines()
    header = lines[0].split("\t")
    rows = [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]
    return [CORPUS / "schemas" / r["file"] for r in rows]


def validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of the draft the schema declares (the latest when it declares none)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
