"""Configuration rules that both sides of the bridge enforce, written once.

The host runs them when its configuration is loaded (if the page size is known) and again after
the handshake against the page size the driver *resolved*; the driver runs them on `Hello`.
"""

from __future__ import annotations

from bridge_schema.errors import ConfigError


def check_prefix_match_unit(prefix_match_unit: int, page_size: int, speculation_depth: int) -> None:
    """Prefix reuse matches whole pages. 0 turns it off. With speculation on, the unit must be
    exactly the page size: a sub-page match would let a staged write land in a shared page."""
    if prefix_match_unit == 0:
        return
    if page_size <= 0:
        raise ConfigError(f"page size must be positive, got {page_size}", "page_size")
    if speculation_depth > 0 and prefix_match_unit != page_size:
        raise ConfigError(
            f"with speculation on, prefix_match_unit must equal the page size {page_size} "
            f"(got {prefix_match_unit}; sub-page matching is rejected)",
            "prefix_match_unit",
        )
    if prefix_match_unit > page_size or page_size % prefix_match_unit:
        raise ConfigError(
            f"prefix_match_unit {prefix_match_unit} must divide the page size {page_size}", "prefix_match_unit"
        )
