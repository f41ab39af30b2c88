"""The engine core on its own: no thread, no loop, no driver. A test plays the loop (next_batch,
then complete with made-up results), which is what the core being thread-free buys: each verb's
rule can be checked step by step, deterministically."""

from __future__ import annotations

import concurrent.futures

import pytest

from bridge_schema.batch import OutputResult, OutputSpec, Sampler
from bridge_schema.messages import DEFERRED_TOKENS, Handshake
from host.engine import EngineConfig
from host.engine.core import EngineCore
from host.engine.passes import resolve
from host.engine.scheduler import Batch
from host.engine.speculation import build_core
from host.errors import ContextLimitExceeded, DriverFailed, EngineClosed, InvalidRequest, PageQuotaExceeded
from host.services import PassRequest, PassResult

PAGE = 4
RUN = 1


def handshake(capabilities: tuple[str, ...] = ()) -> Handshake:
    return Handshake(
        capabilities=list(capabilities),
        model_name="test",
        vocab_size=300,
        page_size=PAGE,
        num_pages=64,
        max_context=4096,
        max_requests_per_pass=64,
        max_tokens_per_pass=4096,
        max_probe_k=8,
    )


def core(capabilities: tuple[str, ...] = (DEFERRED_TOKENS,), **config: int) -> EngineCore:
    return build_core(EngineConfig("loopback", **config), handshake(capabilities))  # type: ignore[arg-type]


def decode(token: int) -> PassRequest:
    return PassRequest(tokens=[token], outputs=[OutputSpec(0, Sampler())])


def answer(c: EngineCore, tokens: list[int], settle: bool = True) -> None:
    """Play the driver for the next batch: its outputs sample `tokens` in order; then, as the
    engine's lock does when released, give the waiters their outcomes (unless not `settle`)."""
    batch = c.next_batch()
    assert isinstance(batch, Batch)
    picks = iter(tokens)
    outputs = [[OutputResult(next(picks)) for _ in chunk.spec.outputs] for chunk in batch.chunks]
    c.complete(batch, outputs, 0.001)
    if settle:
        resolve(c.take_handovers())


def test_the_kept_context_is_what_one_run_may_hold() -> None:
    # 64 pages of 4 tokens: 256 tokens in all, 128 under a half-pool run quota; the handshake's
    # 4096 stays the model's context (a run that releases pages may use it).
    assert core().model.kept_context == 256 and core().model.max_context == 4096
    assert core(max_run_page_fraction=0.5).model.kept_context == 128  # type: ignore[arg-type]
    assert core(max_group_page_fraction=0.25).model.kept_context == 64  # type: ignore[arg-type]


def test_a_pass_goes_in_with_submit_and_comes_back_through_complete() -> None:
    c = core()
    ctx = c.create_context(RUN)
    waiter: concurrent.futures.Future[PassResult] = concurrent.futures.Future()
    assert c.submit(RUN, ctx, PassRequest(tokens=[1, 2, 3], outputs=[OutputSpec(2, Sampler())]), waiter) is None
    assert not waiter.done()  # nothing moves until the loop asks for a batch
    answer(c, [42])
    assert waiter.result(0).outputs[0].token == 42
    assert c.pages.length(ctx) == 3 and c.num_in_flight == 0


@pytest.mark.parametrize("verb", ["fork", "truncate", "release pages of"])
def test_a_context_with_a_pending_pass_cannot_be_forked_truncated_or_punched(verb: str) -> None:
    c = core()
    ctx = c.create_context(RUN)
    c.submit(RUN, ctx, PassRequest(tokens=list(range(1, 10)), outputs=[OutputSpec(8, Sampler())]), _future())
    act = {
        "fork": lambda: c.fork_context(RUN, ctx),
        "truncate": lambda: c.truncate_context(RUN, ctx, 2),
        "release pages of": lambda: c.release_slots(RUN, ctx, 0, 8),
    }[verb]
    with pytest.raises(InvalidRequest, match=f"cannot {verb} context {ctx} while a forward pass on it is pending"):
        act()
    answer(c, [7])
    act()  # settled: allowed now


def test_shut_down_fails_every_waiter_left() -> None:
    c = core()
    ctx = c.create_context(RUN)
    queued, sent = _future(), _future()
    c.submit(RUN, ctx, decode(1), sent)
    assert c.next_batch() is not None  # in flight when the loop ends
    other = c.create_context(RUN)
    c.submit(RUN, other, decode(2), queued)
    c.shut_down()
    resolve(c.take_handovers())
    for waiter in (queued, sent):
        with pytest.raises(EngineClosed):
            waiter.result(0)
    with pytest.raises(EngineClosed):
        c.create_context(RUN)


def test_complete_hands_results_over_for_after_the_lock_instead_of_resolving_them() -> None:
    """A waiter's code (a woken run thread, a generation's next step) never runs under the
    engine's lock: the core collects the outcomes, whoever releases the lock gives them out."""
    c = core(speculation_depth=1)
    ctx = c.create_context(RUN)
    waiter = _future()
    c.submit(RUN, ctx, decode(5), waiter)
    answer(c, [9], settle=False)
    assert not waiter.done()
    handovers = c.take_handovers()
    assert [(w, r.outputs[0].token) for w, r in handovers] == [(waiter, 9)]  # type: ignore[union-attr]
    resolve(handovers)
    assert waiter.result(0).outputs[0].token == 9 and c.take_handovers() == []


def test_a_driver_that_cannot_fill_in_deferred_tokens_gets_no_speculation() -> None:
    assert type(core((), speculation_depth=1)) is EngineCore
    assert type(core(speculation_depth=1)) is not EngineCore


def test_a_slot_served_from_a_staged_pass_is_named_for_prefix_reuse() -> None:
    """A decode step answered by a pre-fired pass adds its slot to the context's history too,
    so the page it completes can be reused by the next context with the same prefix."""
    c = core(prefix_match_unit=PAGE, speculation_depth=1, page_size=PAGE)
    ctx = c.create_context(RUN)
    c.submit(RUN, ctx, PassRequest(tokens=[1, 2], outputs=[OutputSpec(1, Sampler())]), _future())
    answer(c, [50])
    c.submit(RUN, ctx, decode(50), _future())  # a plain decode step, cold
    answer(c, [60])  # its next step (60 at position 3) is pre-fired now
    served = _future()
    assert c.submit(RUN, ctx, decode(60), served) is None  # taken by the staged pass, still out
    answer(c, [70])
    assert served.result(0).outputs[0].token == 70
    assert c.speculation_stats()["speculation_hits"] == 1
    again = c.create_context(RUN)  # the same first page: 1, 2, 50, 60
    c.submit(RUN, again, PassRequest(tokens=[1, 2, 50, 60, 70], outputs=[OutputSpec(4, Sampler())]), _future())
    assert c.contexts.prefix.stats()["prefix_tokens_reused"] == PAGE


def test_a_request_waiting_on_a_staged_pass_fails_when_the_engine_shuts_down() -> None:
    """A staged pass's result reaches the request that took it through the core's waiters, like
    every pass's; so does the error when the loop ends before it returned."""
    c = core(speculation_depth=1)
    ctx = c.create_context(RUN)
    c.submit(RUN, ctx, decode(5), _future())
    answer(c, [6])  # the step after it (6) is pre-fired now
    served = _future()
    assert c.submit(RUN, ctx, decode(6), served) is None  # taken; it has not been sent yet
    assert c.speculation_stats()["speculation_hits"] == 1
    c.shut_down()
    resolve(c.take_handovers())
    with pytest.raises(EngineClosed):
        served.result(0)


def test_a_failed_pass_takes_the_step_staged_after_it_along() -> None:
    """The next step was staged as the pass went out, its token left to the driver: if that pass
    fails, the step can never be right and must not go out."""
    c = core(speculation_depth=1)
    ctx = c.create_context(RUN)
    failed = _future()
    c.submit(RUN, ctx, decode(5), failed)
    batch = c.next_batch()
    assert batch is not None and c.speculation_stats()["speculation_staged"] == 1
    c.fail(batch, DriverFailed("the pass failed"))
    resolve(c.take_handovers())
    with pytest.raises(DriverFailed):
        failed.result(0)
    assert c.next_batch() is None


def test_with_speculation_off_nothing_is_pre_fired() -> None:
    c = core(speculation_depth=0)
    ctx = c.create_context(RUN)
    c.submit(RUN, ctx, decode(5), _future())
    answer(c, [6])
    assert c.next_batch() is None  # no staged step waits
    assert type(c) is EngineCore and c.speculation_stats()["speculation_hits"] == 0


def test_a_context_may_be_made_with_an_id_chosen_above_once() -> None:
    """Replicas choose context ids unique across them and hand them down."""
    c = core()
    assert c.create_context(RUN, 2) == 2
    with pytest.raises(InvalidRequest, match="context id 2 is in use"):
        c.create_context(RUN, 2)
    assert c.create_context(RUN) == 1 and c.create_context(RUN) == 3  # the counter steps over 2
    assert c.fork_context(RUN, 2, 9) == 9


def _future() -> concurrent.futures.Future[PassResult]:
    return concurrent.futures.Future()


def test_a_run_holds_at_most_max_run_contexts_forks_included() -> None:
    c = core(max_run_contexts=3)  # type: ignore[arg-type]
    first = c.create_context(RUN)
    c.fork_context(RUN, first)
    c.create_context(RUN)
    with pytest.raises(ContextLimitExceeded, match=r"run 1 holds 3 contexts.*run_max_contexts"):
        c.create_context(RUN)
    with pytest.raises(ContextLimitExceeded):
        c.fork_context(RUN, first)
    assert c.create_context(RUN + 1)  # another run's count is its own
    c.release_context(RUN, first)
    c.fork_context(RUN, c.contexts.of_run(RUN)[0])  # a release frees a place
    c.end_run(RUN)
    assert [c.create_context(RUN) for _ in range(3)]  # an ended run's contexts are all freed


def test_an_api_key_cannot_take_the_pool_s_last_pages_from_another() -> None:
    # 64 pages; two keys with a 0.75 share each would leave the third none.
    c = core(max_run_page_fraction=0.75, max_group_page_fraction=0.75, group_reserve_page_fraction=0.125)  # type: ignore[arg-type]
    for run, key in ((1, "a"), (2, "b"), (3, "c")):
        c.contexts.set_group(run, key)
    fills = {}
    for run, num_pages in ((1, 48), (2, 8)):
        fills[run] = c.create_context(run)
        c.submit(run, fills[run], PassRequest(tokens=[1] * (num_pages * PAGE)), _future())
    other = c.create_context(2)
    with pytest.raises(PageQuotaExceeded, match="key_reserve_pages_fraction"):
        c.submit(2, other, PassRequest(tokens=[1]), _future())
    third = c.create_context(3)
    c.submit(3, third, PassRequest(tokens=[1] * (8 * PAGE)), _future())  # the last 8 pages
