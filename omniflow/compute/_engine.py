"""``Engine`` (the interface) and ``TorchEngine`` (our own engine), the async shell.

>>> import omniflow as of
>>> async def main(model_dir):
...     async with of.TorchEngine(model_dir, max_batch=16) as engine:
...         req = of.GenerateRequest(prompt="Hello", sampling=of.SamplingParams(temperature=0))
...         return [out.token_id async for out in engine.generate(req)]

The decisions are made by the pure ``Scheduler``; this module only carries them out: it admits
requests (tokenize, build on the session's history, match the cached prefix in the pool), runs
one step at a time on a dedicated thread (allocating pages first), turns sampled tokens into
``StepOutput``s, and at the end publishes the sequence's full pages and releases its slots.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from omniflow._exceptions import PoolExhaustedError
from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError, RequestError
from omniflow.compute._inputs import build_inputs
from omniflow.compute._kv import KvCache, PagePool, page_keys
from omniflow.compute._loader import load_model
from omniflow.compute._request import GenerateRequest, StepOutput
from omniflow.compute._runner import ModelRunner
from omniflow.compute._sampling import make_generator
from omniflow.compute._scheduler import Scheduler, StepPlan
from omniflow.compute._segments import SegmentFeeds
from omniflow.compute._sequence import SeqStatus, Sequence
from omniflow.compute._session import SessionHistory
from omniflow.compute._stream import Stream
from omniflow.compute._tokenizer import Tokenizer

__all__ = ["Engine", "TorchEngine"]


class Engine(abc.ABC):
    """What every engine offers a role: start, generate (streaming), abort, stop."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load and get ready; idempotent (a role calls it from ``setup()``)."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        """One ``StepOutput`` per generated token; leaving the iterator aborts the request."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a request now; its slots are freed by the end of the running step."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Abort everything and free the engine's resources."""

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class TorchEngine(Engine):
    """A continuous-batching engine for Llama-family checkpoints, KV cache in a ``ParamsPool``.

    ``pool``: a ``ParamsPool``, the name of one declared in the graph (looked up in the current
    role's context at ``start()``), or None for a private pool sized by ``pool_pages``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        pool: Any = None,
        max_batch: int = 16,
        max_step_tokens: int = 512,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        page_tokens: int = 16,
        pool_pages: int = 4096,
        max_sessions: int = 1024,
    ) -> None:
        self.model_dir = Path(model_dir)  #: the Hugging Face-format directory
        self.max_batch = max_batch  #: sequences decoded together
        self.max_step_tokens = max_step_tokens  #: tokens per step (prefill chunk budget)
        self.device, self.dtype = device, dtype  #: as requested ("auto" resolved at start)
        self.page_tokens = page_tokens  #: tokens per KV page (a private pool's layout)
        self.pool_pages = pool_pages  #: L1 pages of a private pool
        self._pool_arg = pool
        self.kv_pool: PagePool | None = None  #: the ParamsPool in use once started
        self.config: ModelConfig | None = None  #: the model's config once started
        self.tokenizer: Tokenizer | None = None  #: None when the directory has no tokenizer.json
        self.history = SessionHistory(max_sessions)  #: Layer 1 of prefix reuse
        self._streams: dict[str, Stream] = {}
        self._release: list[Stream] = []  #: finished/aborted, slots to publish/free
        self._inflight: set[str] = set()  #: request ids in the running step
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = asyncio.Lock()
        self._stopped = False
        self._own_pool = False  #: the engine made its pool (and closes it at stop)

    @staticmethod
    def pool(
        model_dir: str | Path,
        name: str = "kv",
        *,
        capacity: dict[str, int] | None = None,
        page_tokens: int = 16,
        dtype: str = "float32",
        **kwargs: Any,
    ) -> Any:
        """A ``ParamsPool`` whose layout fits ``model_dir``'s KV cache (declare it in the graph)."""
        from omniflow.compute._pool import pool_for

        cfg = ModelConfig.from_dir(model_dir)
        return pool_for(
            cfg, name, capacity=capacity, page_tokens=page_tokens, dtype=dtype, **kwargs
        )

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        async with self._start_lock:
            if self._task is not None:
                return
            if self._stopped:
                raise EngineError(f"engine for {str(self.model_dir)!r} was stopped; make a new one")
            loop = asyncio.get_running_loop()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="omniflow-engine")
            model = await loop.run_in_executor(
                self._executor,
                lambda: load_model(self.model_dir, device=self.device, dtype=self.dtype),
            )
            self.config = model.cfg
            if (self.model_dir / "tokenizer.json").exists():
                self.tokenizer = Tokenizer.from_dir(self.model_dir)
            from omniflow.compute._pool import resolve_pool

            self.kv_pool = await resolve_pool(self, model)
            self.page_tokens = _page_tokens(self.kv_pool, self.page_tokens)
            self._kv = KvCache(self.kv_pool, model.cfg.num_layers, self.page_tokens)
            self._runner = ModelRunner(model, self._kv)
            self._sched = Scheduler(max_batch=self.max_batch, max_step_tokens=self.max_step_tokens)
            self._segments = SegmentFeeds(self, model.cfg)
            self._task = loop.create_task(self._run(), name="omniflow-engine-loop")
            self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """If the step loop dies, every waiting caller gets the error instead of hanging."""
        if task.cancelled() or task.exception() is None:
            return
        exc = EngineError(f"the engine's step loop failed: {task.exception()!r}")
        exc.__cause__ = task.exception()
        self._task = None
        for stream in list(self._streams.values()):
            stream.fail(exc)
            stream.released.set()

    async def stop(self) -> None:
        self._stopped = True
        task, self._task = self._task, None
        for stream in list(self._streams.values()):
            stream.fail(EngineError("the engine was stopped"))
            self._cancel(stream)
        self._wake.set()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self._drain_releases()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._own_pool and self.kv_pool is not None:
            await self.kv_pool.aclose()  # type: ignore[attr-defined]

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StepOutput]:
        if self._task is None:
            raise EngineError("the engine is not started; await engine.start() first")
        stream = await self._admit(request)
        try:
            while True:
                out = await stream.next()
                yield out
                if out.finished:
                    return
        finally:
            await self._leave(stream)

    # ---- segmented input (the paper's segmented emission, pipelined prefill) ---------------
    async def open(self, request: GenerateRequest, *, idle_timeout: float = 60.0) -> str:
        """Admit ``request`` with its input left open and return its request id.

        What the request holds is prefilled at once (after matching the session's cached
        prefix); ``feed`` appends further segments, each prefilled as soon as it arrives, and
        the last one closes the input, after which tokens are sampled and read with
        ``outputs``. An open request that is neither fed nor read for ``idle_timeout`` seconds
        is aborted (its caller is gone), so a cancelled producer never pins pool pages.
        """
        if self._task is None:
            raise EngineError("the engine is not started; await engine.start() first")
        stream = await self._admit(request, input_open=True)
        self._segments.watch(stream, idle_timeout)
        return stream.seq.request_id

    def feed(self, request_id: str, segment: Any, *, last: bool = False) -> int:
        """Append one input segment to an open request; returns the sequence's length after it.

        ``segment``: token ids, a ``(n, hidden_size)`` tensor of embedding rows, or a list of
        those. ``last=True`` closes the input. The segment joins the sequence between steps.
        """
        return self._segments.feed(request_id, segment, last=last)

    async def outputs(self, request_id: str) -> AsyncIterator[StepOutput]:
        """The ``StepOutput``s of an opened request (leaving the iterator aborts it)."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise RequestError(f"no open request {request_id!r}", field="request_id")
        self._segments.reading(request_id)
        try:
            while True:
                out = await stream.next()
                yield out
                if out.finished:
                    return
        finally:
            await self._leave(stream)

    async def _leave(self, stream: Stream) -> None:
        if not stream.closed:
            self._cancel(stream)
            self._wake.set()
        # Leaving the iterator returns only once the request's slots are back in the pool.
        await stream.released.wait()

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(EngineError(f"request {request_id!r} was aborted"))
            self._cancel(stream)
            self._wake.set()

    def _cancel(self, stream: Stream) -> None:
        if stream.closed:
            return
        stream.closed = True
        stream.seq.finish_reason = stream.seq.finish_reason or "abort"
        self._sched.remove(stream.seq)
        self._release.append(stream)

    async def _admit(self, request: GenerateRequest, *, input_open: bool = False) -> Stream:
        assert self.config is not None and self.kv_pool is not None
        tokens, embeds = build_inputs(request, self.config, self.tokenizer, self.history)
        params = request.sampling
        stops = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self._eos_ids()
        )
        seq = Sequence(
            request.request_id,
            tokens,
            max_new_tokens=params.max_new_tokens,
            stop_ids=stops,
            embeds=embeds,
        )
        seq.input_open = input_open
        if request.request_id in self._streams:
            raise RequestError(
                f"request id {request.request_id!r} is already running", field="request_id"
            )
        stream = Stream(seq, request.session, self.tokenizer, params.stop_strings)
        self._streams[seq.request_id] = stream
        try:
            await self._match_prefix(stream)
        except BaseException:
            self._streams.pop(seq.request_id, None)
            await self.kv_pool.release(seq.request_id)
            raise
        self._runner.attach(seq)
        if not params.greedy:
            self._runner.sampling[seq.request_id] = (params, make_generator(params))
        self._sched.add(seq)
        self._wake.set()
        return stream

    def _eos_ids(self) -> frozenset[int]:
        assert self.config is not None
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    async def _match_prefix(self, stream: Stream) -> None:
        """Full matching: the longest published prefix of the session becomes computed KV."""
        seq, pool = stream.seq, self.kv_pool
        assert pool is not None
        usable = (len(seq.tokens) - 1) // self.page_tokens  # the last token is always computed
        if usable == 0:
            return
        hashes = _chain(page_keys(seq, usable, self.page_tokens))
        match = await pool.match(stream.session, hashes, seq.request_id)
        pages = min(int(match.pages), usable)
        seq.slots = list(match.slots[:pages])
        seq.num_computed = seq.cached_tokens = pages * self.page_tokens

    # ---- the step loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        """One step at a time. The tokens a step sampled are delivered (detokenized, stop
        strings checked, queued to their callers) while the next step's forward pass runs, so
        delivery is off the step-to-step critical path; ids and lengths that end a sequence are
        checked first, so a finished sequence is never scheduled again."""
        loop = asyncio.get_running_loop()
        sampled: list[tuple[Sequence, int, str | None]] = []  #: not yet delivered
        while True:
            await self._drain_releases()
            self._segments.apply()
            if not self._sched.has_work():
                if sampled:  # deliver, then drain the releases that finished before sleeping
                    self._deliver_tokens(sampled)
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = await self._allocate(self._sched.schedule())
            if not plan.items:
                self._deliver_tokens(sampled)
                continue
            self._inflight = {s.request_id for s, _ in plan.items}
            step = loop.run_in_executor(self._executor, self._runner.step, plan)
            self._deliver_tokens(sampled)
            try:
                tokens = await step
            except Exception as exc:  # a model error fails the step's requests, not the engine
                for seq, _ in plan.items:
                    self._fail(seq, EngineError(f"forward pass failed: {exc!r}"))
                continue
            finally:
                self._inflight = set()
            for (seq, n), token in zip(plan.items, tokens, strict=True):
                if seq.status is SeqStatus.FINISHED:
                    continue  # aborted (or stopped by a stop string) while the step ran
                seq.num_computed += n
                if token is not None:
                    reason = seq.append(token)
                    if reason is not None:
                        self._sched.remove(seq)
                    sampled.append((seq, token, reason))

    def _deliver_tokens(self, sampled: list[tuple[Sequence, int, str | None]]) -> None:
        for seq, token, reason in sampled:
            self._on_token(seq, token, reason)
        sampled.clear()

    def _on_token(self, seq: Sequence, token: int, reason: str | None) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None or stream.closed:
            return  # aborted since the token was sampled
        out = stream.on_token(token, reason)
        if out.finished:
            self._sched.remove(seq)  # a stop string: its next step's token is dropped
            seq.finish_reason = out.finish_reason
            stream.closed = True
            stream.final = out
            self._release.append(stream)
        else:
            stream.push(out)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.fail(exc)
            self._cancel(stream)

    async def _allocate(self, plan: StepPlan) -> StepPlan:
        """Get the pages the plan needs; a sequence the pool cannot fit is preempted."""
        assert self.kv_pool is not None
        kept = StepPlan()
        for seq, n in plan.items:
            need = seq.pages_needed(n, self.page_tokens)
            if need:
                try:
                    fresh = await self.kv_pool.alloc(seq.request_id, need)
                except PoolExhaustedError as exc:
                    await self._preempt(seq, exc)
                    continue
                self._runner.clear(fresh)
                seq.slots.extend(fresh)
                self._runner.attach(seq)
            kept.items.append((seq, n))
        return kept

    async def _preempt(self, seq: Sequence, exc: PoolExhaustedError) -> None:
        assert self.kv_pool is not None
        others = [s for s in self._sched.running if s is not seq]
        if not others:
            self._fail(
                seq,
                EngineError(
                    f"request {seq.request_id!r}: the KV pool cannot hold {len(seq.tokens)} "
                    f"tokens even alone ({exc}); raise the pool's capacity or shorten the prompt"
                ),
            )
            return
        # Layer 1 makes this safe: the tokens stay on the host, the KV is recomputed later.
        await self.kv_pool.release(seq.request_id)
        self._runner.detach_pages(seq.request_id)
        seq.slots, seq.num_computed = [], 0
        self._sched.requeue(seq)

    async def _drain_releases(self) -> None:
        """Publish finished sequences' full pages, free every released sequence's slots."""
        assert self.kv_pool is not None
        while self._release:
            stream = self._release.pop(0)
            seq = stream.seq
            if seq.request_id in self._inflight:  # pragma: no cover - loop is between steps
                self._release.append(stream)
                return
            try:
                if stream.final is not None and stream.session is not None:
                    full = min(seq.num_computed // self.page_tokens, len(seq.slots))
                    if full:
                        hashes = _chain(page_keys(seq, full, self.page_tokens))
                        await self.kv_pool.publish(stream.session, hashes, seq.slots[:full])
                    self.history.record(stream.session, seq.tokens, seq.embeds)
            finally:
                await self.kv_pool.release(seq.request_id)
                self._runner.detach(seq.request_id)
                self._streams.pop(seq.request_id, None)
                if stream.final is not None:
                    stream.push(stream.final)
                stream.released.set()

    def statistics(self) -> dict[str, int]:
        """Running/waiting sequences and sessions held (observability)."""
        sched = getattr(self, "_sched", None)
        return {
            "running": len(sched.running) if sched else 0,
            "waiting": len(sched.waiting) if sched else 0,
            "sessions": len(self.history),
        }


def _chain(keys: list[list[int] | bytes]) -> list[str]:
    from omniflow.compute._pool import chain_hashes

    return chain_hashes(keys)


def _page_tokens(pool: Any, default: int) -> int:
    layout = getattr(pool, "layout", None)
    return int(getattr(layout, "page_tokens", default))
