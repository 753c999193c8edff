"""What every engine of ours shares: weights, the pool, and the batching loop (the async shell).

>>> # class MyEngine(EngineBase[MyRequest, MyOutput, MyStream]):
>>> #     architectures = frozenset({"MyArch"})
>>> #     def _load_model(self): ...            # on the engine's thread
>>> #     def _build(self, model, pool): ...    # runner + pure scheduler over the pool
>>> #     async def _admit(self, request): ...  # request -> stream (matching, pins)
>>> #     async def _plan(self): ...            # schedule, then self._carry_out(plan)
>>> #     def _step(self, plan): ...            # one forward pass, on the engine's thread
>>> #     def _apply(self, plan, result): ...   # outputs -> streams (or kept for _emit)

``TorchEngine`` (the Llama-family LLM) and ``DiTEngine`` (denoising on the LLM path) are both
subclasses: one checkpoint loader (a safetensors directory whose ``config.json`` names the
architecture), one way to get the KV ``ParamsPool`` (an object, a graph's pool by name, a private
one, or a seat at a co-located ``KvPoolBarrier``), and one loop: drain releases, plan a step,
run it on the engine's single thread (the event loop keeps serving), apply its results, and
deliver them to the streams while the next step runs. Subclasses decide what a sequence is and
what a step computes; the decisions stay in their pure schedulers.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, Self, TypedDict, TypeVar

import torch

from omniflow._exceptions import PoolExhaustedError
from omniflow.compute._arch import (
    check_architecture,
    engine_for_architecture,
    read_architectures,
    register,
)
from omniflow.compute._colocate import PoolSeat
from omniflow.compute._errors import EngineError, EngineProcessError
from omniflow.compute._kv import KvCache, PagePool
from omniflow.compute._outbox import StreamLike
from omniflow.compute._pages import PageIO, PageOp
from omniflow.compute._pool import resolve_pool

__all__ = [
    "EngineBase",
    "EngineOptions",
    "engine_for_architecture",
    "read_architectures",
]


class EngineOptions(TypedDict, total=False):
    """The keywords every engine passes on to ``EngineBase`` (their defaults live there once; an
    engine with other defaults sets them before passing on)."""

    pool: Any
    max_batch: int
    device: str | torch.device
    dtype: str | torch.dtype
    page_tokens: int
    pool_pages: int
    share_weights: bool


class _Output(Protocol):
    @property
    def finished(self) -> bool: ...


class _Seq(Protocol):
    request_id: str
    finish_reason: str | None


class _Scheduler(Protocol):
    def has_work(self) -> bool: ...

    def remove(self, seq: Any) -> None: ...

    def allocated(self, seq: Any, slots: list[int]) -> None: ...

    def refused(self, plan: Any, seq: Any, why: str) -> None: ...


class _Runner(Protocol):
    def attach(self, seq: Any) -> None: ...


ReqT = TypeVar("ReqT")
OutT = TypeVar("OutT", bound=_Output)
StreamT = TypeVar("StreamT", bound=StreamLike)


class EngineBase(abc.ABC, Generic[ReqT, OutT, StreamT]):
    """Lifecycle, pool access and the step loop shared by our engines.

    ``pool``: a ``ParamsPool``; the name of one declared in the graph (looked up in the role's
    context at ``start()``); a ``KvPoolBarrier.member(role, pages)`` seat (the co-located pool,
    decided once every member loaded its weights); or None for a private pool of
    ``pool_pages`` L1 pages.
    """

    #: config.json architectures this engine runs (others are refused with the right class)
    architectures: ClassVar[frozenset[str]] = frozenset()
    _kv: KvCache  #: the pool seam, once the pool is open
    _runner: _Runner  #: the subclass's model runner (page views per sequence), once built

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register(cls, cls.__dict__.get("architectures", frozenset()))

    def __init__(
        self,
        model_dir: str | Path,
        *,
        pool: Any = None,
        max_batch: int = 16,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        page_tokens: int = 16,
        pool_pages: int = 4096,
        share_weights: bool = True,
    ) -> None:
        self.model_dir = Path(model_dir)  #: the checkpoint directory
        #: On the CPU, bind the weights to the node's one copy of this checkpoint (replicas and
        #: co-located roles over one checkpoint hold one copy); False: a private copy. On a GPU
        #: the copy is private either way (logged once: ``_loader.shares_weights``).
        self.share_weights = share_weights
        self.max_batch = max_batch  #: sequences computed together
        self.device, self.dtype = device, dtype  #: as requested ("auto" resolved at start)
        self.page_tokens = page_tokens  #: tokens per KV page (a private pool's layout)
        self.pool_pages = pool_pages  #: L1 pages of a private pool
        self._pool_arg = pool
        self._seat = pool if isinstance(pool, PoolSeat) else None  #: a co-located pool's seat
        self.kv_pool: PagePool | None = None  #: the ParamsPool in use once started
        self._streams: dict[str, StreamT] = {}  #: request_id -> live stream
        self._release: list[StreamT] = []  #: finished/aborted, slots to publish/free
        self._inflight: set[str] = set()  #: request ids in the running step
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = asyncio.Lock()
        self._ready: asyncio.Future[None] | None = None  #: done once pool and runner exist
        self._sched: _Scheduler | None = None  #: the subclass's pure scheduler, once built
        self._stopped = False
        self._failure: BaseException | None = None  #: what ended the step loop, if it died
        self._reaper: asyncio.Task[None] | None = None  #: releases the pages of a dead loop
        self._own_pool = False  #: the engine made its pool (and closes it at stop)
        self.steps = 0  #: forward passes run (observability)

    # ---- what a subclass provides ----------------------------------------------------------
    @abc.abstractmethod
    def _load_model(self) -> Any:
        """Read the checkpoint (on the engine's thread); the model has ``cfg``, ``device``,
        ``dtype``, and ``cfg`` has ``num_layers``, ``num_kv_heads``, ``head_dim``."""

    def _loaded(self, model: Any) -> None:
        """After the weights are loaded, before the pool exists (e.g. read the tokenizer)."""

    @abc.abstractmethod
    def _build(self, model: Any, pool: PagePool) -> _Scheduler:
        """Make the runner over ``pool``; return the pure scheduler."""

    @abc.abstractmethod
    async def _admit(self, request: ReqT) -> StreamT:
        """Validate, build the sequence, match/pin its pages, add it to the scheduler."""

    @abc.abstractmethod
    async def _plan(self) -> Any:
        """The next step's plan (scheduled, pages allocated); falsy when nothing can run."""

    @abc.abstractmethod
    def _plan_ids(self, plan: Any) -> set[str]:
        """Request ids computed by ``plan``."""

    @abc.abstractmethod
    def _step(self, plan: Any) -> Any:
        """One forward pass (on the engine's thread)."""

    def _launch(self, plan: Any) -> asyncio.Future[Any]:
        """Start ``plan``'s forward pass; the future holds ``_step``'s result. Default: on the
        engine's thread (an engine whose forward runs elsewhere overrides this)."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self._step, plan)

    @abc.abstractmethod
    def _apply(self, plan: Any, result: Any) -> None:
        """Turn a step's result into outputs (and finish sequences)."""

    @abc.abstractmethod
    def _plan_seqs(self, plan: Any) -> list[Any]:
        """The sequences of ``plan`` (failed together when the forward pass raises)."""

    @abc.abstractmethod
    async def _page_io(self, io: PageIO[Any]) -> None:
        """Carry out a ``PREEMPT`` or ``FAIL`` of the plan (``_carry_out`` does ``ALLOC``)."""

    async def _on_release(self, stream: StreamT) -> None:
        """Before a finished/aborted sequence's pins are released (e.g. publish its pages)."""

    def _detach(self, request_id: str) -> None:
        """Forget a released sequence's runner state."""

    def _close_model(self) -> None:
        """Free what ``_load_model`` holds beyond the weights (an engine process); at stop and
        when start fails."""

    def _between_steps(self) -> None:
        """After releases, before the next plan (e.g. inputs that arrived for open requests)."""

    def _emit(self) -> bool:
        """Deliver the outputs ``_apply`` left for later; True when there were any.

        The loop calls this right after it hands the next step to the engine's thread, so the
        delivery (the LLM's detokenizing and stop-string checks) runs while that forward pass
        does; also before it sleeps, and when a plan came out empty. An engine whose ``_apply``
        delivers at once (the DiT's queue pushes) keeps this default."""
        return False

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Load weights and get the pool (idempotent; a role calls it from ``setup()``).

        With a ``KvPoolBarrier`` seat, ``start`` returns once the weights are loaded and the
        proposal is made; requests wait until every co-located member has proposed."""
        async with self._start_lock:
            if self._task is not None:
                return
            if self._stopped:
                raise EngineError(f"engine for {str(self.model_dir)!r} was stopped; make a new one")
            loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="omniflow-engine")
            seat = self._seat
            try:
                check_architecture(type(self), self.model_dir)
                if seat is not None:
                    seat.arrive()  # partners in other processes see this role load (or die)
                model = await loop.run_in_executor(self._executor, self._load_model)
                self._loaded(model)
                if seat is not None:
                    # Weights are in: what is free now sizes the pool (after the last proposal).
                    seat.propose(self._page_bytes(model), model.device)
                else:
                    await self._open(model)
            except BaseException as exc:
                if seat is not None:
                    seat.abort(exc)  # partners waiting at the barrier fail now, not at timeout
                self._executor.shutdown(wait=False)
                self._close_model()
                self._executor, self._ready = None, None  # start() may be retried
                raise
            self._task = loop.create_task(self._run(model), name="omniflow-engine-loop")
            self._task.add_done_callback(self._loop_ended)

    def _page_bytes(self, model: Any) -> int:
        """Bytes of one KV page of ``model`` (a measured proposal's unit)."""
        from omniflow.compute._pool import layout_for

        dtype = str(model.dtype).removeprefix("torch.")
        return int(layout_for(model.cfg, page_tokens=self.page_tokens, dtype=dtype).page_bytes)

    async def _open(self, model: Any) -> None:
        """Resolve the pool, build the runner and the scheduler; the engine is then ready."""
        if self._ready is None or self._ready.done():
            return
        self.kv_pool = await resolve_pool(self, model)
        layout = getattr(self.kv_pool, "layout", None)
        self.page_tokens = int(getattr(layout, "page_tokens", self.page_tokens))
        self._kv = KvCache(self.kv_pool, model.cfg.num_layers, self.page_tokens)
        self._sched = self._build(model, self.kv_pool)
        self._ready.set_result(None)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """If the step loop dies, every waiting caller gets the error instead of hanging."""
        if task.cancelled() or task.exception() is None:
            return
        exc = EngineError(f"the engine's step loop failed: {task.exception()!r}")
        exc.__cause__ = task.exception()
        self._task, self._failure = None, exc
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(exc)
            self._ready.exception()  # retrieved here; waiters get it re-raised
        for stream in list(self._streams.values()):
            stream.fail(exc)
            self._cancel(stream)
            stream.released.set()
        if self.kv_pool is not None and self._release:  # their pages go back to the pool now
            self._reaper = asyncio.get_running_loop().create_task(self._drain_releases())

    async def stop(self) -> None:
        """Abort everything and free the engine's resources."""
        self._stopped = True
        task, self._task = self._task, None
        for stream in list(self._streams.values()):
            stream.fail(EngineError("the engine was stopped"))
            self._cancel(stream)
        self._wake.set()
        if self._ready is not None and not self._ready.done():  # still waiting at a barrier
            self._ready.set_exception(EngineError("the engine was stopped"))
            self._ready.exception()  # retrieved here; waiters get it re-raised
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._reaper is not None:
            await asyncio.gather(self._reaper, return_exceptions=True)  # stop finishes anyway
        if self.kv_pool is not None:
            await self._drain_releases()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._close_model()
        if self._own_pool and self.kv_pool is not None:
            await self.kv_pool.aclose()  # type: ignore[attr-defined]
        if self._seat is not None:
            await self._seat.leave()  # the last co-located engine to stop closes the pool

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- requests --------------------------------------------------------------------------
    async def generate(self, request: ReqT) -> AsyncIterator[OutT]:
        """The request's outputs as they are computed; leaving the iterator aborts it."""
        stream = await self._submit(request)
        async with contextlib.aclosing(self._deliver(stream)) as outs:  # closed with this one
            async for out in outs:
                yield out

    async def _deliver(self, stream: StreamT) -> AsyncGenerator[OutT, None]:
        """A stream's outputs up to the last; leaving early aborts the request, and returns only
        once its slots are back in the pool."""
        try:
            while True:
                out = await stream.next()
                yield out
                if out.finished:
                    return
        finally:
            if not stream.closed:
                self._cancel(stream)
                self._wake.set()
            # Leaving the iterator returns only once the request's slots are back in the pool.
            await stream.released.wait()

    async def _submit(self, request: ReqT) -> StreamT:
        await self._until_ready()
        return await self._admit(request)

    async def _until_ready(self) -> None:
        """Refuse before ``start()``; with a co-located pool, wait until every member proposed."""
        if self._failure is not None:
            raise EngineError(
                f"the engine failed ({self._failure.__cause__!r}); stop it and start a new one"
            ) from self._failure
        if self._task is None or self._ready is None:
            raise EngineError("the engine is not started; await engine.start() first")
        await asyncio.shield(self._ready)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its slots are freed by the end of the running step."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(EngineError(f"request {request_id!r} was aborted"))
            self._cancel(stream)
            self._wake.set()

    def _cancel(self, stream: StreamT) -> None:
        if stream.closed:
            return
        stream.closed = True
        stream.seq.finish_reason = stream.seq.finish_reason or "abort"
        if self._sched is not None:
            self._sched.remove(stream.seq)
        self._release.append(stream)

    def _finish(self, stream: StreamT, final: Any) -> None:
        """``stream``'s sequence is done; ``final`` is delivered once its pins are released."""
        assert self._sched is not None
        self._sched.remove(stream.seq)
        stream.closed = True
        stream.final = final
        self._release.append(stream)

    def _fail(self, seq: _Seq, exc: BaseException) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.fail(exc)
            self._cancel(stream)

    # ---- the step loop ---------------------------------------------------------------------
    async def _run(self, model: Any) -> None:
        """One step at a time. What step N produced is applied at once (state that decides
        scheduling: lengths, stop ids) and delivered (``_emit``) while step N+1's forward pass
        runs, so delivery is off the step-to-step critical path."""
        await self._open_seat(model)
        assert self._sched is not None
        sched = self._sched
        while True:
            await self._drain_releases()
            self._between_steps()
            if not sched.has_work():
                if self._emit():  # delivered; drain the releases that finished before sleeping
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = await self._plan()
            if not plan:
                self._emit()
                continue
            self._inflight = self._plan_ids(plan)
            step = self._launch(plan)
            self._emit()  # step N's outputs, while step N+1 runs on the engine's thread
            try:
                result = await step
            except EngineProcessError:
                raise  # the engine's process is gone: every request fails (_loop_ended)
            except Exception as exc:  # a model error fails the step's requests, not the engine
                for seq in self._plan_seqs(plan):
                    self._fail(seq, EngineError(f"forward pass failed: {exc!r}"))
                continue
            finally:
                self._inflight = set()
            self.steps += 1
            self._apply(plan, result)

    async def _carry_out(self, plan: Any) -> None:
        """Carry out ``plan.io`` (the pool I/O its scheduler decided) in order and report each
        outcome back; a refusal lets the scheduler decide again (it may change the rest)."""
        pool, sched = self.kv_pool, self._sched
        assert pool is not None and sched is not None
        while plan.io:
            io = plan.io.popleft()
            if io.op is PageOp.ALLOC:
                try:
                    fresh = await pool.alloc(io.seq.request_id, io.pages)
                except PoolExhaustedError as exc:
                    sched.refused(plan, io.seq, str(exc))
                    continue
                self._kv.zero(fresh)
                sched.allocated(io.seq, fresh)
                self._runner.attach(io.seq)
            else:
                await self._page_io(io)

    async def _open_seat(self, model: Any) -> None:
        """With a barrier seat: wait for the co-located pool, then open it."""
        if self._seat is not None and self._ready is not None and not self._ready.done():
            self._pool_arg = await self._seat.wait()
            await self._open(model)

    async def _drain_releases(self) -> None:
        """Publish/free every released sequence's slots, then deliver its last output."""
        assert self.kv_pool is not None
        while self._release:
            stream = self._release.pop(0)
            seq = stream.seq
            if seq.request_id in self._inflight:  # pragma: no cover - loop is between steps
                self._release.append(stream)
                return
            try:
                if stream.final is not None:
                    await self._on_release(stream)
            finally:
                await self.kv_pool.release(seq.request_id)
                self._detach(seq.request_id)
                self._streams.pop(seq.request_id, None)
                if stream.final is not None:
                    stream.push(stream.final)
                stream.released.set()

    def _running_counts(self) -> dict[str, int]:
        sched: Any = self._sched
        return {
            "running": len(sched.running) if sched is not None else 0,
            "waiting": len(sched.waiting) if sched is not None else 0,
            "steps": self.steps,
        }
