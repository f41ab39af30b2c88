"""docs/writing-inferlets.md names every public name of the SDK (`inferlet.__all__`), each in
code (inline or in an example), so an author who reads the guide meets the whole API."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sdk_names() -> list[str]:
    tree = ast.parse((ROOT / "inferlets" / "sdk" / "inferlet" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.List | ast.Tuple)
            return [ast.literal_eval(e) for e in node.value.elts]
    raise AssertionError("inferlet/__init__.py has no __all__")


def test_the_authors_guide_names_every_public_name_of_the_sdk() -> None:
    guide = (ROOT / "docs" / "writing-inferlets.md").read_text()
    blocks = re.findall(r"```.*?```", guide, flags=re.S)  # code examples
    inline = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", guide, flags=re.S))
    quoted = " ".join(blocks + inline)
    names = _sdk_names()
    assert len(names) > 20
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", quoted)]
    assert not missing, f"docs/writing-inferlets.md does not name {missing}"
