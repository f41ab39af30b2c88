"""`host.engine.adapters`: names resolve only inside the adapter directory, and the table of loaded
adapters is bounded, unloading the least recently used one no run holds."""

from __future__ import annotations

import pytest

from host.engine.adapters import AdapterNameError, AdapterSlotsFull, AdapterTable, resolve


def test_names_resolve_inside_the_directory() -> None:
    assert resolve("/srv/adapters", "math-lora") == "/srv/adapters/math-lora"
    assert resolve("/srv/adapters", "team_a/v1.2") == "/srv/adapters/team_a/v1.2"


@pytest.mark.parametrize(
    "name", ["", "/etc/passwd", "..", "../x", "a/../../x", "./x", "a/./b", "a//b", "a/", ".env", "a b", "x" * 201]
)
def test_anything_else_is_refused(name: str) -> None:
    with pytest.raises(AdapterNameError, match="is not a name inside the adapter directory"):
        resolve("/srv/adapters", name)


def test_without_a_directory_adapters_are_off() -> None:
    with pytest.raises(AdapterNameError, match="adapters are off"):
        resolve("", "math-lora")


def test_the_table_unloads_the_least_recently_used_unheld_adapter() -> None:
    table = AdapterTable(max_loaded=2)
    for name in ("a", "b"):
        adapter_id, victim = table.plan_load(in_use=set())
        assert victim is None
        table.loaded(name, adapter_id)
    assert table.lookup("a") == 0  # "a" is now the most recently used
    assert table.plan_load(in_use=set()) == (2, 1)  # so "b" goes first
    assert table.plan_load(in_use={1}) == (2, 0)  # unless a run holds it
    with pytest.raises(AdapterSlotsFull, match="all 2 adapter slots"):
        table.plan_load(in_use={0, 1})
    table.unloaded(1)
    table.loaded("c", 2)
    assert (table.lookup("b"), table.lookup("c"), len(table)) == (None, 2, 2)
    assert table.plan_load(in_use=set())[0] == 3  # ids are never reused
