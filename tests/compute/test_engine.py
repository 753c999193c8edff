"""TorchEngine behaviour: cancel/abort, sampling, chat, embeds, errors, off-loop forward."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import omniflow as of
from omniflow.compute import EngineError, GenerateRequest, RequestError, SamplingParams

from .conftest import EXECUTORS, greedy, hf_greedy, run

pytestmark = pytest.mark.timeout(300)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [5 + (i * 11 + salt * 17) % 300 for i in range(n)]


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_cancel_mid_generation_frees_every_slot_and_spares_the_others(
    model_dirs: Callable[[str], Path], engine_factory: Any, executor: str
) -> None:
    engine = await engine_factory(model_dirs("llama"), max_batch=8, executor=executor)
    pool = engine.kv_pool
    prompts = [prompt(n, salt=i) for i, n in enumerate((20, 45, 33, 70))]
    alone = [
        (await run(engine, GenerateRequest(input_ids=p, sampling=greedy(40))))[0] for p in prompts
    ]
    assert pool.stats()["pinned"] == 0

    victim = GenerateRequest(input_ids=prompt(90, salt=7), sampling=greedy(200))
    got_five = asyncio.Event()

    async def cancelled() -> int:
        n = 0
        agen = engine.generate(victim)
        async for _ in agen:
            n += 1
            if n == 5:
                got_five.set()
                break
        await agen.aclose()  # type: ignore[attr-defined]
        # the slots are free the moment leaving the iterator returns
        assert not pool.holds(victim.request_id)
        return n

    tasks = [
        asyncio.ensure_future(run(engine, GenerateRequest(input_ids=p, sampling=greedy(40))))
        for p in prompts
    ]
    assert await cancelled() == 5
    results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == alone
    assert pool.stats()["pinned"] == 0
    assert engine.statistics()["running"] == 0


async def test_cancelling_the_consumer_task_aborts_the_request(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    started = asyncio.Event()
    req = GenerateRequest(input_ids=prompt(30), sampling=greedy(500))

    async def consume() -> None:
        async for _ in engine.generate(req):
            started.set()

    task = asyncio.ensure_future(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not engine.kv_pool.holds(req.request_id)
    assert engine.kv_pool.stats()["pinned"] == 0


async def test_abort_by_id_ends_the_stream_with_an_error(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    req = GenerateRequest(input_ids=prompt(10), sampling=greedy(500))
    seen = 0
    with pytest.raises(EngineError, match="aborted"):
        async for _ in engine.generate(req):
            seen += 1
            if seen == 3:
                engine.abort(req.request_id)
    assert seen >= 3
    assert engine.kv_pool.stats()["pinned"] == 0


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(
    model_dirs: Callable[[str], Path], engine_factory: Any, executor: str
) -> None:
    engine = await engine_factory(model_dirs("llama"), executor=executor)
    params = SamplingParams(max_new_tokens=24, temperature=1.3, top_p=0.9, top_k=50, seed=1234)
    p = prompt(12)
    alone, _ = await run(engine, GenerateRequest(input_ids=p, sampling=params))
    crowd = await asyncio.gather(
        run(engine, GenerateRequest(input_ids=p, sampling=params)),
        *(
            run(engine, GenerateRequest(input_ids=prompt(9, i), sampling=greedy(24)))
            for i in range(3)
        ),
    )
    assert crowd[0][0] == alone
    other, _ = await run(
        engine,
        GenerateRequest(
            input_ids=p, sampling=SamplingParams(max_new_tokens=24, temperature=1.3, seed=99)
        ),
    )
    assert other != alone  # 24 draws from a ~380-token vocabulary at T=1.3


async def test_top_k_one_and_tiny_top_p_are_greedy(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("qwen2"))
    p = prompt(15)
    want, _ = await run(engine, GenerateRequest(input_ids=p, sampling=greedy(20)))
    for params in (
        SamplingParams(max_new_tokens=20, temperature=2.0, top_k=1, ignore_eos=True),
        SamplingParams(max_new_tokens=20, temperature=0.7, top_p=1e-6, ignore_eos=True, seed=3),
    ):
        got, _ = await run(engine, GenerateRequest(input_ids=p, sampling=params))
        assert got == want


async def test_stop_ids_stop_strings_and_length(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    tok = engine.tokenizer
    p = tok.encode("Hello, how are you?")
    outs = [o async for o in engine.generate(GenerateRequest(input_ids=p, sampling=greedy(30)))]
    ids = [o.token_id for o in outs]
    text = "".join(o.text for o in outs)
    assert text == tok.decode(ids)  # the streamed deltas add up to the decoded text
    assert outs[-1].finished and outs[-1].finish_reason == "length" and len(outs) == 30
    assert all(not o.finished for o in outs[:-1])

    k = next(i for i in range(3, 30) if ids[i] not in ids[:i])
    stopped = [
        o
        async for o in engine.generate(
            GenerateRequest(
                input_ids=p,
                sampling=SamplingParams(
                    max_new_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=(ids[k],)
                ),
            )
        )
    ]
    assert [o.token_id for o in stopped] == ids[: k + 1]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].text == ""

    target = text[len(text) // 3 : len(text) // 3 + 3]
    cut = text.index(target)
    if target.strip():
        by_string = [
            o
            async for o in engine.generate(
                GenerateRequest(
                    input_ids=p,
                    sampling=SamplingParams(
                        max_new_tokens=30, temperature=0.0, ignore_eos=True, stop=target
                    ),
                )
            )
        ]
        assert "".join(o.text for o in by_string) == text[:cut]
        assert by_string[-1].finish_reason == "stop"


async def test_eos_ends_generation_unless_ignored(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    p = prompt(20)
    ids, _ = await run(engine, GenerateRequest(input_ids=p, sampling=greedy(64)))
    eos = engine.tokenizer.eos_token_id
    plain, _ = await run(
        engine,
        GenerateRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=64, temperature=0)),
    )
    want = ids[: ids.index(eos) + 1] if eos in ids else ids
    assert plain == want


async def test_chat_messages_use_the_models_template(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any
) -> None:
    from transformers import AutoTokenizer

    path = model_dirs("qwen2")
    engine = await engine_factory(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    hf_tok = AutoTokenizer.from_pretrained(path)
    want_ids = list(
        hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert engine.tokenizer.apply_chat_template(messages) == want_ids
    got, _ = await run(engine, GenerateRequest(prompt=messages, sampling=greedy(16)))
    assert got == hf_greedy(reference(path), want_ids, 16)


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_embeds_enter_as_segments_and_key_the_cache(
    model_dirs: Callable[[str], Path], reference: Any, engine_factory: Any, executor: str
) -> None:
    path = model_dirs("llama")
    engine = await engine_factory(path, executor=executor)
    head, image_ids, tail = prompt(10), prompt(24, salt=4), prompt(5, salt=8)
    embed = reference(path).get_input_embeddings().weight.detach()
    rows = embed[torch.tensor(image_ids)].clone()  # an "encoder output"
    want = hf_greedy(reference(path), [*head, *image_ids, *tail], 16)
    req = GenerateRequest(input_ids=head, embeds=[rows, tail], session="m", sampling=greedy(16))
    got, cached = await run(engine, req)
    assert got == want and cached == 0
    again, cached2 = await run(
        engine,
        GenerateRequest(input_ids=head, embeds=[rows, tail], session="m", sampling=greedy(16)),
    )
    assert again == want and cached2 == 32
    other = rows.clone()
    other[3] += 1.0  # a different image: the pages holding it no longer match
    _, cached3 = await run(
        engine,
        GenerateRequest(input_ids=head, embeds=[other, tail], session="m", sampling=greedy(4)),
    )
    assert cached3 == 0


async def test_the_forward_pass_runs_off_the_event_loop(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    loop_ran = threading.Event()
    real_step = engine._runner.step
    on_loop: list[bool] = []

    def step(plan: Any) -> Any:
        on_loop.append(threading.current_thread() is threading.main_thread())
        # only returns once the event loop has run another coroutine meanwhile
        assert loop_ran.wait(timeout=20), "the event loop was blocked while the model ran"
        return real_step(plan)

    engine._runner.step = step

    async def ticker() -> None:
        await asyncio.sleep(0)
        loop_ran.set()

    gen = asyncio.ensure_future(
        run(engine, GenerateRequest(input_ids=prompt(8), sampling=greedy(2)))
    )
    await asyncio.sleep(0)
    await ticker()
    ids, _ = await gen
    assert len(ids) == 2 and on_loop and not any(on_loop)


async def test_bad_requests_get_typed_actionable_errors(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"))
    with pytest.raises(RequestError, match="outside the vocabulary") as info:
        await run(engine, GenerateRequest(input_ids=[1, 10**6]))
    assert info.value.field == "input_ids"
    with pytest.raises(RequestError, match="expected"):
        await run(engine, GenerateRequest(embeds=torch.zeros(3, 7)))
    with pytest.raises(RequestError, match="step"):
        await run(engine, GenerateRequest(input_ids=[5], session="nobody", step=10))
    with pytest.raises(RequestError):
        GenerateRequest()
    with pytest.raises(RequestError, match="session"):
        GenerateRequest(input_ids=[1], step=3)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(EngineError, match="not started"):
        await run(of.TorchEngine(model_dirs("llama")), GenerateRequest(input_ids=[5]))
    assert engine.kv_pool.stats()["pinned"] == 0


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_start_is_idempotent_and_stop_fails_pending_requests(
    model_dirs: Callable[[str], Path], executor: str, capfd: pytest.CaptureFixture[str]
) -> None:
    engine = of.TorchEngine(model_dirs("llama"), executor=executor)
    await asyncio.gather(engine.start(), engine.start())
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(
            GenerateRequest(input_ids=prompt(5), sampling=greedy(10**4))
        ):
            started.set()

    task = asyncio.ensure_future(consume())
    await started.wait()
    await engine.stop()
    with pytest.raises(EngineError, match="stopped"):
        await task
    with pytest.raises(EngineError, match="stopped"):
        await engine.start()
    assert "Traceback" not in capfd.readouterr().err  # nor from the engine process


async def _until(cond: Callable[[], bool], what: str, *, limit_s: float = 120.0) -> None:
    """Poll ``cond`` until it holds. The limit only turns a hang into a failure: it is far
    above what a loaded machine needs, so the test does not depend on how fast steps run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"not after {limit_s:g} s: {what}")
        await asyncio.sleep(0.002)


async def _computed(engine: Any, rid: str, at_least: int) -> int:
    """Wait until ``rid`` has ``at_least`` tokens of KV."""
    seq = engine._streams[rid].seq
    await _until(lambda: seq.num_computed >= at_least, f"{rid} computed {at_least} tokens")
    return int(seq.num_computed)


async def test_segmented_input_is_prefilled_as_it_arrives_and_equals_one_shot(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"), max_batch=4)
    hidden = engine.config.hidden_size
    rows = torch.randn(13, hidden, generator=torch.Generator().manual_seed(3))
    head, tail = prompt(21), prompt(9, salt=2)
    whole, _ = await run(engine, GenerateRequest(embeds=[head, rows, tail], sampling=greedy(24)))

    rid = await engine.open(GenerateRequest(input_ids=head, sampling=greedy(24)))
    # the open segment is prefilled at once, all but its last token, and nothing is sampled
    assert await _computed(engine, rid, len(head) - 1) == len(head) - 1
    assert engine.feed(rid, rows) == len(head) + 13
    assert await _computed(engine, rid, len(head) + 12) == len(head) + 12
    seq = engine._streams[rid].seq
    assert seq.num_generated == 0 and seq.input_open
    for _ in range(50):  # idle while open: no more tokens are computed
        await asyncio.sleep(0)
    assert seq.num_computed == len(head) + 12
    assert engine.feed(rid, tail, last=True) == len(head) + 13 + len(tail)
    outs = [out async for out in engine.outputs(rid)]
    assert [o.token_id for o in outs] == whole
    assert outs[-1].prompt_tokens == len(head) + 13 + len(tail)
    with pytest.raises(RequestError, match="no open input"):
        engine.feed(rid, [1, 2])


async def test_segment_errors_and_an_abandoned_open_request_frees_its_pages(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    engine = await engine_factory(model_dirs("llama"), max_batch=4)
    pool = engine.kv_pool
    rid = await engine.open(GenerateRequest(input_ids=prompt(40), sampling=greedy(4)))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.feed(rid, [10**6])
    with pytest.raises(RequestError, match=r"expected \(n >= 1, "):
        engine.feed(rid, torch.zeros(2, 3))
    engine.feed(rid, [7, 8], last=True)
    with pytest.raises(RequestError, match="already fed"):
        engine.feed(rid, [9])
    assert len([o async for o in engine.outputs(rid)]) == 4
    with pytest.raises(RequestError, match="no open input"):
        engine.feed("nope", [1])
    # a producer that goes away: the open request is aborted and its pages are freed
    with pytest.raises(RequestError, match="idle_timeout"):
        await engine.open(GenerateRequest(input_ids=prompt(5)), idle_timeout=0)
    gone = await engine.open(GenerateRequest(input_ids=prompt(50), sampling=greedy(4)))
    assert await _computed(engine, gone, 49) == 49
    assert pool.holds(gone)
    # its idle period runs out now (not after a prefill raced a short timeout on a busy box)
    entry = engine._segments._open[gone]
    entry.timeout = 0.01
    engine._segments._arm(entry)
    await _until(
        lambda: not pool.holds(gone) and gone not in engine._streams,
        f"the idle request {gone} released its pages",
    )
    with pytest.raises(RequestError, match="no open input"):
        engine.feed(gone, [1])


async def test_requests_the_pool_can_never_hold_fail_instead_of_preempting_each_other(
    model_dirs: Callable[[str], Path], engine_factory: Any
) -> None:
    """Four requests of 64 tokens each (16 pages) and a private pool of 12 pages: none fits
    even alone. The scheduler's budget (the pool's size) fails each when it asks for its 13th
    page, rather than letting them preempt each other forever, while a small one beside them
    finishes (tests/compute/test_scheduler_pages.py holds the decisions)."""
    engine = await engine_factory(
        model_dirs("llama"), pool_pages=12, page_tokens=4, max_batch=4, max_step_tokens=32
    )
    big = [GenerateRequest(input_ids=prompt(40, salt=i), sampling=greedy(24)) for i in range(4)]
    small = GenerateRequest(input_ids=prompt(6), sampling=greedy(4))
    # on the old rule this never returned (the module's timeout ends it)
    results = await asyncio.gather(*(run(engine, r) for r in [*big, small]), return_exceptions=True)
    for r in results[:4]:
        assert isinstance(r, EngineError) and "even alone" in str(r), r
    assert not isinstance(results[4], BaseException) and len(results[4][0]) == 4
    assert engine.kv_pool.stats()["pinned"] == 0
