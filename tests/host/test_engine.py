"""The engine against the real dummy driver: a subprocess on a Unix socket, and in-process over
loopback (which still encodes every frame). No mocks: page copies and batching are checked through
the driver's own Health counters."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bridge_schema.batch import OutputSpec, Sampler
from bridge_schema.messages import Probe
from host.engine import Engine, EngineConfig
from host.engine.facade import GROUP_SLICE
from host.errors import (
    ContextNotFound,
    ContextNotOwned,
    DriverFailed,
    EngineClosed,
    InvalidRequest,
    OutOfPages,
    PageQuotaExceeded,
)
from host.services import PassRequest

PAGE = 16
_runs = itertools.count(1)


@pytest.fixture(scope="module", params=["dummy", "loopback"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    # The dummy acks adapter loads without reading files: the directory need not exist.
    with Engine.start(
        EngineConfig(
            request.param,
            ["--num-pages", "512", "--page-size", str(PAGE)],
            adapter_dir="/adapters",
            max_loaded_adapters=2,
        )
    ) as e:
        yield e


@pytest.fixture
def run_id(engine: Engine) -> Iterator[int]:
    rid = next(_runs)
    yield rid
    engine.end_run(rid)


def fill(engine: Engine, run: int, ctx: int, tokens: list[int], sampler: Sampler | None = None) -> int:
    result = engine.forward(
        run, ctx, PassRequest(tokens=tokens, outputs=[OutputSpec(len(tokens) - 1, sampler or Sampler())])
    )
    (out,) = result.outputs
    return out.token


def test_create_fill_and_decode(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    token = fill(engine, run_id, ctx, prompt)
    generated = [token]
    for _ in range(20):
        generated.append(fill(engine, run_id, ctx, [generated[-1]], Sampler.random(seed=7)))
    assert engine.context_length(run_id, ctx) == len(prompt) + 20
    assert all(0 <= t < engine.model.vocab_size for t in generated)
    # Greedy on the dummy depends only on (input token, position): a second context agrees.
    other = engine.create_context(run_id)
    assert fill(engine, run_id, other, prompt) == token


def test_fork_shares_full_pages_and_copies_the_partial_page_on_the_driver(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    fill(engine, run_id, ctx, [65] * (2 * PAGE + 5))  # two full pages and a partial one
    before = engine.driver_health()
    child = engine.fork_context(run_id, ctx)
    parent_pages, child_pages = engine.context_pages(ctx), engine.context_pages(child)
    assert child_pages[:2] == parent_pages[:2]
    assert child_pages[2] != parent_pages[2]
    assert [engine.page_refcount(p) for p in parent_pages] == [2, 2, 1]
    assert engine.context_length(run_id, child) == 2 * PAGE + 5
    fill(engine, run_id, child, [66])  # the Copy goes out before this pass
    after = engine.driver_health()
    assert int(after["copies"]) - int(before["copies"]) == 1
    assert int(after["pages_copied"]) - int(before["pages_copied"]) == 1
    engine.release_context(run_id, ctx)
    assert [engine.page_refcount(p) for p in child_pages] == [1, 1, 1]


def test_writing_after_truncating_into_a_shared_page_sends_a_copy(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    fill(engine, run_id, ctx, [70] * (2 * PAGE))
    child = engine.fork_context(run_id, ctx)
    engine.truncate_context(run_id, child, PAGE + 3)
    before = engine.driver_health()
    fill(engine, run_id, child, [71, 72])
    assert int(engine.driver_health()["pages_copied"]) - int(before["pages_copied"]) == 1
    assert engine.context_pages(child)[1] != engine.context_pages(ctx)[1]


def test_long_fill_is_chunked_under_the_driver_limit() -> None:
    with Engine.start(EngineConfig("loopback", ["--max-tokens-per-pass", "64", "--page-size", "8"])) as e:
        ctx = e.create_context(1)
        before = int(e.driver_health()["forwards"])
        fill(e, 1, ctx, [80] * 300)
        assert int(e.driver_health()["forwards"]) - before >= 5
        assert e.context_length(1, ctx) == 300


def test_a_long_fill_is_cut_at_the_drivers_preferred_chunk_unless_the_host_sets_its_own() -> None:
    # The handshake's max_fill_chunk_tokens (the torch driver: 512 on the CPU) cuts a fill into
    # passes of at most that many tokens; the engine's own setting, where given, wins.
    for host_chunk, want_forwards in ((0, 5), (100, 3)):
        args = ["--max-fill-chunk-tokens", "64", "--page-size", "8"]
        with Engine.start(EngineConfig("loopback", args, max_fill_chunk_tokens=host_chunk)) as e:
            ctx = e.create_context(1)
            before = int(e.driver_health()["forwards"])
            fill(e, 1, ctx, [80] * 300)
            assert int(e.driver_health()["forwards"]) - before == want_forwards, host_chunk
            assert e.context_length(1, ctx) == 300


def test_sixty_four_concurrent_runs_complete(engine: Engine) -> None:
    num_runs, num_tokens = 64, 24
    outputs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(rid: int) -> None:
        try:
            ctx = engine.create_context(rid)
            tokens = [fill(engine, rid, ctx, engine.tokenizer.encode(f"prompt number {rid}"))]
            for _ in range(num_tokens - 1):
                tokens.append(fill(engine, rid, ctx, [tokens[-1]], Sampler.random(seed=rid)))
            outputs[rid] = tokens
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            engine.end_run(rid)

    rids = [next(_runs) for _ in range(num_runs)]
    free_before = engine.num_free_pages
    threads = [threading.Thread(target=run, args=(rid,)) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert sorted(outputs) == rids
    assert all(len(tokens) == num_tokens for tokens in outputs.values())
    assert engine.num_free_pages == free_before


def test_out_of_pages_is_a_clear_error_and_changes_nothing() -> None:
    with Engine.start(EngineConfig("loopback", ["--num-pages", "4", "--page-size", "8"])) as e:
        ctx = e.create_context(1)
        fill(e, 1, ctx, [1] * 20)  # 3 of 4 pages
        with pytest.raises(OutOfPages, match="out of KV pages"):
            fill(e, 1, ctx, [1] * 20)
        assert e.context_length(1, ctx) == 20
        other = e.create_context(1)
        with pytest.raises(OutOfPages):
            fill(e, 1, other, [2] * 9)
        e.release_context(1, ctx)
        fill(e, 1, other, [2] * 9)
        e.end_run(1)
        assert e.num_free_pages == 4


def test_end_run_frees_every_page_of_the_run(engine: Engine) -> None:
    rid = next(_runs)
    free = engine.num_free_pages
    ctx = engine.create_context(rid)
    fill(engine, rid, ctx, [3] * 50)
    engine.fork_context(rid, ctx)
    engine.create_context(rid)
    assert engine.num_free_pages < free
    engine.end_run(rid)
    assert engine.num_free_pages == free
    with pytest.raises(ContextNotFound):
        engine.context_length(rid, ctx)


def test_contexts_are_owned_by_their_run(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    with pytest.raises(ContextNotOwned):
        engine.forward(run_id + 10_000, ctx, PassRequest(tokens=[1]))
    engine.release_context(run_id, ctx)
    with pytest.raises(ContextNotFound):
        engine.forward(run_id, ctx, PassRequest(tokens=[1]))


def test_an_attention_row_that_attends_to_no_key_is_refused(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    fill(engine, run_id, ctx, [1, 2])
    with pytest.raises(InvalidRequest, match="attention mask row 1 attends to no key"):
        engine.forward(run_id, ctx, PassRequest(tokens=[3, 4], mask_rows=[[0, 3, 1], [4, 0]]))
    assert engine.context_length(run_id, ctx) == 2
    out = engine.forward(
        run_id, ctx, PassRequest(tokens=[3, 4], outputs=[OutputSpec(1)], mask_rows=[[0, 3, 1], [3, 1]])
    )
    assert len(out.outputs) == 1  # a row attending to its own key alone is fine


@pytest.mark.parametrize(
    "request_",
    [
        PassRequest(tokens=[]),
        PassRequest(tokens=[10_000]),
        PassRequest(tokens=[1, 2], positions=[0]),
        PassRequest(tokens=[1, 2], outputs=[OutputSpec(2)]),
        PassRequest(tokens=[1, 2], outputs=[OutputSpec(1), OutputSpec(0)]),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, Sampler.random(temperature=0.0))]),
        PassRequest(tokens=[1], adapter_id=3),
        PassRequest(tokens=[1], mask_rows=[[0, 5]]),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, probe=Probe.LOGPROBS, score_token=10_000)]),
        PassRequest(tokens=[1], outputs=[OutputSpec(0, score_token=5)]),  # scored without the probe
    ],
)
def test_invalid_requests_are_refused_before_the_driver(engine: Engine, run_id: int, request_: PassRequest) -> None:
    ctx = engine.create_context(run_id)
    with pytest.raises(InvalidRequest):
        engine.forward(run_id, ctx, request_)
    assert engine.context_length(run_id, ctx) == 0


def test_masks_and_probes_reach_the_driver(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    allowed = np.zeros(engine.model.vocab_size, dtype=bool)
    allowed[ord("{")] = True
    mask = np.packbits(np.pad(allowed, (0, -len(allowed) % 32)), bitorder="little").view("<u4")
    rows = [[0, 3]] * 3  # every key allowed; the driver ANDs it with causal
    request = PassRequest(tokens=[1, 2, 3], outputs=[OutputSpec(2, logit_mask=mask)], mask_rows=rows)
    (out,) = engine.forward(run_id, ctx, request).outputs
    assert out.token == ord("{")


def test_a_driver_error_fails_the_pass_clearly_and_the_engine_keeps_serving(engine: Engine, run_id: int) -> None:
    ctx = engine.create_context(run_id)
    nothing_allowed = np.zeros((engine.model.vocab_size + 31) // 32, dtype=np.uint32)
    with pytest.raises(DriverFailed, match="allows no token"):
        engine.forward(run_id, ctx, PassRequest(tokens=[1], outputs=[OutputSpec(0, logit_mask=nothing_allowed)]))
    assert engine.context_length(run_id, ctx) == 0  # the failed pass's slots were given back
    assert fill(engine, run_id, ctx, [1, 2, 3]) >= 0


def test_adapters_load_through_the_driver(engine: Engine, run_id: int) -> None:
    adapter = engine.load_adapter(run_id, "lora")  # the dummy acks without loading
    ctx = engine.create_context(run_id)
    engine.forward(run_id, ctx, PassRequest(tokens=[1], outputs=[OutputSpec(0)], adapter_id=adapter))
    assert engine.load_adapter(run_id, "lora") == adapter


@pytest.mark.parametrize("name", ["/etc/passwd", "../../etc/passwd", "a/../../b", ".hidden", "a//b", "", "x\0y"])
def test_adapter_names_are_names_inside_the_adapter_directory(engine: Engine, run_id: int, name: str) -> None:
    loads = int(engine.driver_health()["adapter_loads"])
    with pytest.raises(InvalidRequest, match="is not a name inside the adapter directory"):
        engine.load_adapter(run_id, name.replace("\\0", "\0"))
    assert int(engine.driver_health()["adapter_loads"]) == loads  # nothing reached the driver


def test_loaded_adapters_are_bounded_and_the_least_recently_used_free_one_goes(engine: Engine) -> None:
    holder, other = 9001, 9002
    first = engine.load_adapter(holder, "held")  # max_loaded_adapters=2 in the fixture
    second = engine.load_adapter(other, "free")
    engine.end_run(other)  # "free" is held by nobody now
    unloads = int(engine.driver_health()["adapter_unloads"])
    third = engine.load_adapter(holder, "new")
    assert int(engine.driver_health()["adapter_unloads"]) == unloads + 1  # "free" went, not "held"
    assert engine.num_loaded_adapters == 2 and len({first, second, third}) == 3
    assert engine.load_adapter(holder, "held") == first  # still loaded
    with pytest.raises(InvalidRequest, match="all 2 adapter slots are held by running runs"):
        engine.load_adapter(other, "one-more")  # both loaded adapters belong to a running run
    engine.end_run(holder)
    assert engine.load_adapter(other, "one-more") not in (first, third)
    engine.end_run(other)


def test_tokenizer_and_model_come_from_the_handshake(engine: Engine) -> None:
    assert engine.model.page_size == PAGE
    assert engine.tokenizer.decode(engine.tokenizer.encode("héllo")) == "héllo"
    text = engine.tokenizer.apply_chat_template([("user", "hi")], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_a_driver_that_dies_fails_passes_instead_of_hanging() -> None:
    workdir = tempfile.mkdtemp(prefix="wafer-test-")
    address = f"unix:{os.path.join(workdir, 'd.sock')}"
    proc = subprocess.Popen([sys.executable, "-m", "drivers.dummy", "--listen", address, "--log-level", "WARNING"])
    try:
        while not os.path.exists(address[5:]):
            assert proc.poll() is None, "driver exited"
            time.sleep(0.02)
        engine = Engine.start(EngineConfig(address))
        ctx = engine.create_context(1)
        fill(engine, 1, ctx, [1, 2])
        proc.kill()
        proc.wait()
        with pytest.raises(DriverFailed):
            for _ in range(1000):  # the loss is noticed by the first pass after it
                fill(engine, 1, ctx, [1])
        with pytest.raises(DriverFailed):
            engine.create_context(1)
        engine.close()
        with pytest.raises(EngineClosed):
            engine.create_context(2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_close_fails_waiting_passes() -> None:
    engine = Engine.start(EngineConfig("loopback", ["--pass-latency-ms", "50"]))
    ctx = engine.create_context(1)
    outcome: list[object] = []

    def decode() -> None:
        try:
            while True:
                fill(engine, 1, ctx, [1])
        except EngineClosed as exc:
            outcome.append(exc)

    thread = threading.Thread(target=decode)
    thread.start()
    fill_started = engine.driver_health()
    assert fill_started
    engine.close()
    thread.join()
    assert isinstance(outcome[0], EngineClosed)


def test_unknown_driver_names_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="unknown driver"):
        Engine.start(EngineConfig("cuda"))


@pytest.mark.parametrize("driver", ["dummy", "loopback"])
def test_a_driver_that_fails_to_start_is_a_clear_error(driver: str) -> None:
    with pytest.raises(DriverFailed, match=r"(exited|rejected its options)"):
        Engine.start(EngineConfig(driver, ["--no-such-option"]))


def test_an_address_nobody_listens_on_is_a_clear_error() -> None:
    with pytest.raises(DriverFailed, match="cannot reach the driver"):
        Engine.start(EngineConfig(f"unix:{tempfile.mkdtemp()}/nobody.sock"))


def test_health_checks_and_adapter_loads_interleave_with_passes(engine: Engine) -> None:
    errors: list[BaseException] = []

    def decode(rid: int) -> None:
        try:
            ctx = engine.create_context(rid)
            token = fill(engine, rid, ctx, [1, 2, 3])
            for _ in range(30):
                token = fill(engine, rid, ctx, [token])
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            engine.end_run(rid)

    def control(rid: int) -> None:
        try:
            for i in range(30):
                engine.driver_health()
                engine.load_adapter(rid, f"a{i % 2}")  # the fixture keeps 2 loaded
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            engine.end_run(rid)

    threads = [threading.Thread(target=decode, args=(next(_runs),)) for _ in range(8)]
    threads += [threading.Thread(target=control, args=(next(_runs),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_a_refused_request_fails_alone_when_batched_with_good_ones() -> None:
    with Engine.start(EngineConfig("loopback", ["--pass-latency-ms", "100"])) as e:
        nothing_allowed = np.zeros((e.model.vocab_size + 31) // 32, dtype=np.uint32)
        slow, bad, good = (e.create_context(rid) for rid in (1, 2, 3))
        outcome: dict[str, object] = {}

        def call(name: str, rid: int, ctx: int, request: PassRequest) -> None:
            try:
                outcome[name] = e.forward(rid, ctx, request).outputs[0].token
            except DriverFailed as exc:
                outcome[name] = exc

        bad_request = PassRequest(tokens=[1], outputs=[OutputSpec(0, logit_mask=nothing_allowed)])
        threads = [threading.Thread(target=call, args=("slow", 1, slow, PassRequest([1], outputs=[OutputSpec(0)])))]
        threads[0].start()
        time.sleep(0.03)  # while the slow pass runs, the next two queue up and share a batch
        threads += [
            threading.Thread(target=call, args=("bad", 2, bad, bad_request)),
            threading.Thread(target=call, args=("good", 3, good, PassRequest([2], outputs=[OutputSpec(0)]))),
        ]
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(outcome["bad"], DriverFailed)
        assert isinstance(outcome["good"], int) and isinstance(outcome["slow"], int)


def test_a_hello_the_driver_refuses_is_a_clear_error() -> None:
    with pytest.raises(DriverFailed, match=r"refused the hello.*prefix_match_unit"):
        # No page size asked for, so the configuration boundary cannot judge; the driver's does.
        Engine.start(EngineConfig("loopback", ["--page-size", "16"], prefix_match_unit=8, speculation_depth=1))


def test_fork_and_truncate_wait_for_no_one_they_refuse_while_a_pass_is_pending() -> None:
    with Engine.start(EngineConfig("loopback", ["--pass-latency-ms", "500"])) as e:
        ctx = e.create_context(1)
        thread = threading.Thread(target=fill, args=(e, 1, ctx, [1, 2, 3]))
        thread.start()
        while e.context_length(1, ctx) == 0:  # the pass is accepted (slots reserved) ...
            time.sleep(0.001)
        refused = 0
        for call in (lambda: e.fork_context(1, ctx), lambda: e.truncate_context(1, ctx, 0)):
            try:
                call()
            except InvalidRequest as exc:
                assert "pending" in str(exc)
                refused += 1
        thread.join()
        assert refused >= 1  # ... and still running when at least the first call came
        assert e.context_length(1, ctx) in (0, 3)


def test_a_run_cannot_hold_more_than_its_share_of_the_pages() -> None:
    # 16 pages of 4 tokens, half for one run: 8 pages (32 tokens) fit, the 33rd token does not.
    with Engine.start(EngineConfig("dummy", ["--num-pages", "16", "--page-size", "4"], max_run_page_fraction=0.5)) as e:
        greedy, other = next(_runs), next(_runs)
        ctx = e.create_context(greedy)
        fill(e, greedy, ctx, [65] * 28)  # 7 pages
        second = e.create_context(greedy)  # the quota is the run's, over all its contexts
        fill(e, greedy, second, [66] * 2)  # the 8th
        with pytest.raises(
            PageQuotaExceeded, match=r"run \d+ holds 8 KV pages and this pass needs 1 more, past the quota of 8 \(the"
        ):
            fill(e, greedy, ctx, [67] * 3)
        assert e.context_length(greedy, ctx) == 28  # nothing was allocated
        with pytest.raises(PageQuotaExceeded):
            e.fork_context(greedy, ctx)
        theirs = e.create_context(other)  # the other half is there for another run
        fill(e, other, theirs, [68] * 32)
        e.release_context(greedy, second)
        fill(e, greedy, ctx, [69] * 2)  # within the quota again
        e.end_run(greedy)
        e.end_run(other)


def test_a_speculated_step_stays_within_the_runs_share_of_the_pages() -> None:
    """Speculation reserves each context's next slot ahead of its decode step, and the step it
    serves takes that slot: the reservation is what the quota must check, or a run decoding
    many contexts at a page boundary takes pages past its share (and the others' half)."""
    args = ["--num-pages", "16", "--page-size", "4"]
    with Engine.start(EngineConfig("dummy", args, speculation_depth=1, max_run_page_fraction=0.5)) as e:
        greedy, other = next(_runs), next(_runs)
        contexts = [e.create_context(greedy) for _ in range(4)]
        tokens = {ctx: fill(e, greedy, ctx, [65, 66, 67]) for ctx in contexts}  # a page each
        with pytest.raises(PageQuotaExceeded, match="past the quota of 8"):
            for _ in range(16):
                for ctx in contexts:
                    tokens[ctx] = fill(e, greedy, ctx, [tokens[ctx]])
                    assert e.num_free_pages >= 8, "the run took pages past its share"
        theirs = e.create_context(other)
        fill(e, other, theirs, [68] * 32)  # the other half is there for another run
        e.end_run(greedy)
        e.end_run(other)


def test_the_runs_of_one_group_share_a_quota() -> None:
    # 16 pages of 4 tokens; a run may hold 12, a group 12: two runs of one group cannot take
    # more than 12 together, a run of another group still gets its pages.
    args = ["--num-pages", "16", "--page-size", "4"]
    with Engine.start(EngineConfig("dummy", args, max_run_page_fraction=0.75, max_group_page_fraction=0.75)) as e:
        first, second, stranger = next(_runs), next(_runs), next(_runs)
        for run, group in ((first, "key-a"), (second, "key-a"), (stranger, "key-b")):
            e.set_run_group(run, group)
        fill(e, first, e.create_context(first), [65] * 32)  # 8 pages
        theirs = e.create_context(second)
        fill(e, second, theirs, [66] * 16)  # 4 more: 12
        with pytest.raises(PageQuotaExceeded, match="the runs of its API key hold 12 KV pages"):
            fill(e, second, theirs, [67])
        fill(e, stranger, e.create_context(stranger), [68] * 16)  # the other group's 4
        for run in (first, second, stranger):
            e.end_run(run)


def test_a_big_group_lets_other_threads_take_the_lock_between_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    # A run's group of 1,024 passes is queued a slice at a time: a thread that wants the
    # engine's lock meanwhile (the loop routing a reply, another run's pass) gets it before the
    # group is done. Under one hold, 1,000 submissions kept every other key's passes waiting.
    with Engine.start(EngineConfig("loopback", ["--num-pages", "1100"])) as e:
        run = next(_runs)
        contexts = [e.create_context(run) for _ in range(32 * GROUP_SLICE)]
        submitted, started, seen_at = [0], threading.Event(), []
        submit = e._core.submit

        def counting_submit(*args: object) -> object:
            submitted[0] += 1
            started.set()
            return submit(*args)  # type: ignore[arg-type]

        def other() -> None:
            started.wait(30)
            with e._lock:
                seen_at.append(submitted[0])

        monkeypatch.setattr(e._core, "submit", counting_submit)
        thread = threading.Thread(target=other)
        thread.start()
        group = [(c, PassRequest(tokens=[65], outputs=[OutputSpec(0, Sampler())])) for c in contexts]
        results = e.forward_group(run, group)
        thread.join()
        assert all(r.outputs[0].token >= 0 for r in results)  # type: ignore[union-attr]
        assert seen_at[0] < len(contexts), "another thread waited for the whole group"
        e.end_run(run)
