"""Grammar-constrained output stays valid UTF-8: xgrammar alone takes the 3-byte encoding of a
UTF-16 surrogate (ED A0..BF xx) for a character, which decodes to three U+FFFD and so breaks
maxLength and the text. The matcher refuses it, in its mask and in `accept`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from host.grammar import Grammar, GrammarCompiler, TokenizerSpec, allocate_bitmask
from host.grammar.tokenizer_info import token_table
from host.grammar.utf8_guard import Utf8Guard

from .walk import allowed_ids

QUOTE, LEAD = ord('"'), 0xED
SURROGATE_SECOND = range(0xA0, 0xC0)  # ED followed by these starts a surrogate


def _string_matcher(compiler: GrammarCompiler):  # type: ignore[no-untyped-def]
    matcher = compiler.json_schema({"type": "string", "maxLength": 8}).matcher()
    assert matcher.accept(QUOTE)
    return matcher


def test_after_a_dangling_ed_only_non_surrogate_continuations_are_allowed(byte_compiler: GrammarCompiler) -> None:
    matcher = _string_matcher(byte_compiler)
    assert matcher.accept(LEAD)
    mask = allocate_bitmask(matcher.vocab_size)
    assert matcher.fill_bitmask(mask)
    assert allowed_ids(mask, matcher.vocab_size).tolist() == list(range(0x80, 0xA0))
    assert not matcher.fork().accept(0xA0)  # accept refuses it too
    assert matcher.fork().accept(0x9F)  # ED 9F xx is U+D7xx: a character
    matcher.rollback(1)  # nothing dangles any more: ED is allowed again, A0 is not
    mask[:] = 0
    matcher.fill_bitmask(mask)
    allowed = set(allowed_ids(mask, matcher.vocab_size).tolist())
    assert LEAD in allowed and 0xA0 not in allowed


def test_a_fork_keeps_the_dangling_lead(byte_compiler: GrammarCompiler) -> None:
    matcher = _string_matcher(byte_compiler)
    assert matcher.accept(LEAD)
    twin = matcher.fork()
    assert not twin.accept(0xB0) and twin.accept(0x80)


def test_whole_tokens_with_a_surrogate_inside_are_never_allowed() -> None:
    """A BPE-like table: a token carrying ED A0 inside is refused anywhere; one ending in ED
    sets the lead; one starting with A0..BF is refused only right after it."""
    table = [bytes([i]) for i in range(256)] + [b"a\xed\xa0\x80", b"x\xed", b"\xb0\x80", b"ok"]
    guard = Utf8Guard.from_table(table)
    assert guard.has_surrogate[256] and not guard.is_noop
    assert guard.ends_with_lead[257] and guard.ends_with_lead[LEAD] and not guard.ends_with_lead[259]
    assert guard.refuses(256, after_lead=False)
    assert guard.refuses(258, after_lead=True) and not guard.refuses(258, after_lead=False)
    words = np.full(len(guard.allowed), 0xFFFFFFFF, np.uint32)
    guard.apply(words, after_lead=False)
    assert not words[256 // 32] >> (256 % 32) & 1 and words[259 // 32] >> (259 % 32) & 1


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def long_string(byte_compiler: GrammarCompiler, request: pytest.FixtureRequest) -> Grammar:
    return byte_compiler.json_schema({"type": "string", "maxLength": 300}, max_length_limit=300, backend=request.param)


@pytest.mark.parametrize("seed", range(30))
def test_random_walks_in_a_bounded_string_decode_within_the_bound(long_string: Grammar, seed: int) -> None:
    """Sampling uniformly from the mask (what the dummy driver does) until the string closes: the
    bytes are valid UTF-8 and the string keeps its maxLength. (Without the guard about one
    character in 300 is a surrogate: these walks meet several.)"""
    rng = np.random.default_rng(seed)
    matcher = long_string.matcher()
    assert matcher.accept(QUOTE)
    out = bytearray(b'"')
    mask = allocate_bitmask(matcher.vocab_size)
    while not matcher.is_completed():
        matcher.fill_bitmask(mask)
        allowed = [t for t in allowed_ids(mask, matcher.vocab_size).tolist() if t < 256]
        token = int(rng.choice(allowed))
        assert matcher.accept(token)
        out.append(token)
    text = out.decode("utf-8")  # strict: raises on a surrogate
    assert len(json.loads(text)) <= 300  # escapes (llguidance allows them) count as one character


def test_smollm2_has_tokens_that_could_form_a_surrogate(smol_spec: TokenizerSpec) -> None:
    """Not only the dummy's byte tokenizer: SmolLM2 has tokens ending in ED and tokens starting
    with A0..BF, so the guard matters for the real model too."""
    guard = Utf8Guard.from_table(token_table(smol_spec))
    assert guard.ends_with_lead.any() and guard.completes_one.any()
