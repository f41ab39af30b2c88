"""Matcher: bitmask layout (bit j of word i = token 32i+j), accept/rollback/reset/fork,
jump-forward, termination, and refused arguments."""

from __future__ import annotations

import numpy as np
import pytest

from host.grammar import GrammarCompiler, MatcherError, allocate_bitmask, bitmask_words

from .walk import allowed_ids


def test_bitmask_words_and_allocation() -> None:
    assert [bitmask_words(v) for v in (1, 32, 33, 260, 49152)] == [1, 1, 2, 9, 1536]
    mask = allocate_bitmask(260)
    assert mask.dtype == np.uint32 and mask.shape == (9,)


def test_bitmask_bits_are_exactly_the_tokens_accept_takes(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex(r"[a-c]x|\d+").matcher()
    mask = allocate_bitmask(matcher.vocab_size)
    assert matcher.fill_bitmask(mask) is True
    expected = sorted(b"abc0123456789")
    assert allowed_ids(mask, matcher.vocab_size).tolist() == expected
    # Little-endian bits: token 97 ('a') is bit 1 of word 3.
    assert mask[3] >> 1 & 1 == 1
    for token in range(matcher.vocab_size):
        fork = matcher.fork()
        assert fork.accept(token) == (token in expected), token


def test_mask_allows_stop_tokens_only_where_the_grammar_may_end(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex(r"\d+").matcher()
    mask = allocate_bitmask(matcher.vocab_size)
    assert matcher.accept(ord("7"))
    matcher.fill_bitmask(mask)
    assert allowed_ids(mask, matcher.vocab_size).tolist() == [*b"0123456789", 256, 258]
    assert matcher.is_completed() and not matcher.is_terminated()
    assert not matcher.accept(257), "a control token that is not a stop is never accepted"
    assert matcher.accept(258)
    assert matcher.is_terminated()
    assert not matcher.accept(ord("1")), "nothing after termination"
    with pytest.raises(MatcherError, match="terminated"):
        matcher.fill_bitmask(mask)
    assert matcher.jump_forward() == ""


def test_rollback_undoes_tokens_including_the_stop(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex("abc").matcher()
    assert matcher.accept_tokens([*b"abc", 258]) == 4
    assert matcher.is_terminated() and matcher.num_accepted == 4
    matcher.rollback(2)
    assert not matcher.is_terminated() and matcher.num_accepted == 2
    assert not matcher.accept(ord("x"))
    assert matcher.accept(ord("c"))
    with pytest.raises(MatcherError, match="cannot roll back 4"):
        matcher.rollback(4)
    with pytest.raises(MatcherError):
        matcher.rollback(-1)
    matcher.rollback(0)
    assert matcher.num_accepted == 3


def test_refused_tokens_leave_the_state_alone(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex("ab").matcher()
    assert matcher.accept_tokens([*b"ax"]) == 1
    assert matcher.num_accepted == 1
    assert matcher.accept(ord("b"))


def test_reset_and_fork_are_independent(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex("ab|ac").matcher()
    assert matcher.accept(ord("a"))
    twin = matcher.fork()
    assert twin.accept(ord("b")) and matcher.accept(ord("c"))
    assert twin.num_accepted == matcher.num_accepted == 2
    matcher.reset()
    assert matcher.num_accepted == 0 and matcher.accept(ord("a"))
    assert twin.accept(258) and twin.is_terminated()


def test_jump_forward_gives_forced_text(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.json_schema(
        {"type": "object", "properties": {"name": {"const": "wafer"}}, "required": ["name"]}
    ).matcher()
    assert matcher.jump_forward() == '{"name":"wafer"}'
    matcher = byte_compiler.regex("hello (world|there)").matcher()
    assert matcher.jump_forward() == "hello "


def test_bad_token_ids_and_bitmasks_are_refused(byte_compiler: GrammarCompiler) -> None:
    matcher = byte_compiler.regex("a").matcher()
    with pytest.raises(MatcherError, match="outside the vocabulary"):
        matcher.accept(260)
    with pytest.raises(MatcherError, match="outside the vocabulary"):
        matcher.accept(-1)
    for bad in (np.zeros(9, np.int32), np.zeros(8, np.uint32), np.zeros((1, 9), np.uint32)):
        with pytest.raises(MatcherError, match="uint32 array of shape"):
            matcher.fill_bitmask(bad)
    frozen = np.zeros(9, np.uint32)
    frozen.flags.writeable = False
    with pytest.raises(MatcherError, match="writeable"):
        matcher.fill_bitmask(frozen)
    with pytest.raises(MatcherError, match="C-contiguous"):
        matcher.fill_bitmask(np.zeros(18, np.uint32)[::2])


def test_bitmask_is_the_bridge_logit_mask(byte_compiler: GrammarCompiler) -> None:
    """The words the matcher fills are exactly bridge_schema's logit mask for the allowed ids."""
    from bridge_schema.batch import logit_mask_words, pack_allowed, unpack_allowed

    matcher = byte_compiler.json_object().matcher()
    assert matcher.accept_tokens([*b'{"k":']) == 5
    mask = allocate_bitmask(matcher.vocab_size)
    matcher.fill_bitmask(mask)
    assert matcher.num_words == logit_mask_words(matcher.vocab_size)
    allowed = np.flatnonzero(unpack_allowed(matcher.vocab_size, mask))
    assert (pack_allowed(matcher.vocab_size, allowed) == mask).all()
    assert allowed.tolist() == allowed_ids(mask, matcher.vocab_size).tolist()
    assert ord("{") in allowed and ord('"') in allowed and ord("7") in allowed
