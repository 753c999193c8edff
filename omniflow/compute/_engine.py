"""``Engine`` (the interface) and ``TorchEngine`` (our own LLM engine), the async shell.

>>> import omniflow as of
>>> async def main(model_dir):
...     async with of.TorchEngine(model_dir, max_batch=16) as engine:
...         req = of.GenerateRequest(prompt="Hello", sampling=of.SamplingParams(temperature=0))
...         return [out.token_id async for out in engine.generate(req)]

The decisions are made by the pure ``Scheduler``; this module only carries them out: it admits
requests (tokenize, build on the session's history, match the cached prefix in the pool), does
each plan's pool I/O (allocate, preempt, fail: the scheduler's page budget decided them) and
reports the outcomes back, turns sampled tokens into ``StepOutput``s, and at the end publishes
the sequence's full pages. ``open``/``feed``/``outputs`` take a prompt in segments
(``_segments.SegmentFeeds``). Loading, the pool and the step loop itself (one step at a
time on a dedicated thread, releases between steps) are ``EngineBase``'s, shared with
``DiTEngine``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, Unpack

import torch

from omniflow.compute._base import EngineBase, EngineOptions
from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import EngineError, RequestError
from omniflow.compute._inputs import build_inputs
from omniflow.compute._kv import PagePool, page_keys
from omniflow.compute._loader import load_model, resolve_device
from omniflow.compute._pages import PageIO, PageOp
from omniflow.compute._procrunner import EngineProcess, ProcessRunner
from omniflow.compute._request import GenerateRequest, SamplingParams, StepOutput
from omniflow.compute._runner import ModelRunner
from omniflow.compute._scheduler import Scheduler, StepPlan
from omniflow.compute._segments import SegmentFeeds
from omniflow.compute._sequence import SeqStatus, Sequence
from omniflow.compute._session import SessionHistory
from omniflow.compute._stream import Stream
from omniflow.compute._tokenizer import Tokenizer

__all__ = ["Engine", "PublishedPrefix", "TorchEngine"]


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

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@dataclass(frozen=True, slots=True)
class PublishedPrefix:
    """Where a prefill left a prompt's KV: the chain of its full pages in the pool.

    ``DiTEngine`` matches ``hashes`` under ``session`` and reads those pages in place."""

    session: str | None  #: the chain's session (None: public)
    hashes: tuple[str, ...]  #: ``chain_hashes`` of the full pages, in order
    tokens: int  #: positions those pages hold (pages * page_tokens)

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for a frame between roles (``PublishedPrefix(**d)`` reads it back)."""
        return {"session": self.session, "hashes": list(self.hashes), "tokens": self.tokens}


class TorchEngine(EngineBase[GenerateRequest, StepOutput, Stream], Engine):
    """A continuous-batching engine for Llama-family checkpoints, KV cache in a ``ParamsPool``.

    ``pool``: a ``ParamsPool``, the name of one declared in the graph (looked up in the current
    role's context at ``start()``), a ``KvPoolBarrier.member(...)`` seat, or None for a private
    pool sized by ``pool_pages``.

    ``executor``: where the forward pass runs. ``"thread"`` (the default): a dedicated thread of
    this process. ``"process"``: a process of the engine's own (spawned at ``start``, holding
    the weights and the sampling RNGs; the pool's L1 arrays are shared with it), so a forward
    whose ops are short beside their Python no longer waits for the event loop's GIL. CPU only
    so far, and it reads pages in the pool's own L1 only.
    """

    architectures = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})
    _sched: Scheduler  #: continuous batching (pure), once started

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_step_tokens: int = 512,
        max_sessions: int = 1024,
        executor: str = "thread",
        **options: Unpack[EngineOptions],
    ) -> None:
        super().__init__(model_dir, **options)
        if executor not in ("thread", "process"):
            raise EngineError(
                f"TorchEngine(executor={executor!r}): the forward pass runs on a 'thread' of "
                "this process or in a 'process' of its own"
            )
        self.executor = executor  #: "thread" or "process" (where the forward pass runs)
        self._proc: EngineProcess | None = None  #: the engine process (executor="process")
        self.max_step_tokens = max_step_tokens  #: tokens per step (prefill chunk budget)
        self.config: ModelConfig | None = None  #: the model's config once started
        self.tokenizer: Tokenizer | None = None  #: None when the directory has no tokenizer.json
        self.history = SessionHistory(max_sessions)  #: Layer 1 of prefix reuse
        self._segments: SegmentFeeds | None = None  #: open requests' inputs, once started
        #: (sequence, token, finish reason from ids/length) sampled but not yet delivered
        self._sampled: list[tuple[Sequence, int, str | None]] = []
        self.preemptions = 0  #: sequences sent back to wait (pages released) for want of pages

    @staticmethod
    def pool(
        model_dir: str | Path,
        name: str = "kv",
        *,
        capacity: dict[str, int] | None = None,
        page_tokens: int = 16,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        **kwargs: Any,
    ) -> Any:
        """A ``ParamsPool`` whose layout fits ``model_dir``'s KV cache (declare it in the graph).

        ``dtype`` and ``device`` default to what an engine started with the defaults resolves
        them to (``"auto"``: the checkpoint's dtype on cuda when present, float32 on cpu); give
        the engine's own values when it is started with others."""
        from omniflow.compute._pool import placement, pool_for

        cfg = ModelConfig.from_dir(model_dir)
        dev, dtype_name = placement(cfg, device, dtype)
        return pool_for(
            cfg,
            name,
            capacity=capacity,
            page_tokens=page_tokens,
            dtype=dtype_name,
            device=dev,
            **kwargs,
        )

    # ---- EngineBase hooks ------------------------------------------------------------------
    def _load_model(self) -> Any:
        if self.executor == "thread":
            return load_model(
                self.model_dir, device=self.device, dtype=self.dtype, share=self.share_weights
            )
        if resolve_device(self.device).type != "cpu":
            raise EngineError(
                f"TorchEngine(executor='process') runs on CPU only so far (device "
                f"{self.device!r} resolves to {resolve_device(self.device)}); use "
                "executor='thread' on a GPU"
            )
        self._proc = EngineProcess(self.model_dir, self.device, self.dtype)
        return self._proc.start()  # ModelInfo: cfg, device, dtype (the weights stay there)

    def _close_model(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            runner = getattr(self, "_runner", None)  # None when start failed before _build
            if isinstance(runner, ProcessRunner):
                runner.close()
            proc.close()

    def _loaded(self, model: Any) -> None:
        self.config = model.cfg
        if (self.model_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_dir(self.model_dir)

    def _build(self, model: Any, pool: PagePool) -> Scheduler:
        if self._proc is not None:
            self._runner: ModelRunner | ProcessRunner = ProcessRunner(
                self._proc, self._kv, model, max_rows=self.max_step_tokens
            )
        else:
            self._runner = ModelRunner(model, self._kv)
        self._sched = sched = Scheduler(
            max_batch=self.max_batch,
            max_step_tokens=self.max_step_tokens,
            page_tokens=self.page_tokens,
            # A private pool is this engine's alone: its pages are the budget, and the plan
            # preempts before asking. A shared pool's refusals are reported as they come.
            budget=self.pool_pages if self._own_pool else None,
        )
        self._segments = SegmentFeeds(self, model.cfg)
        return sched

    def _plan_ids(self, plan: StepPlan) -> set[str]:
        return {s.request_id for s, _ in plan.items}

    def _plan_seqs(self, plan: StepPlan) -> list[Sequence]:
        return [s for s, _ in plan.items]

    def _step(self, plan: StepPlan) -> list[int | None]:
        assert isinstance(self._runner, ModelRunner)  # executor="thread"
        return self._runner.step(plan)

    def _launch(self, plan: StepPlan) -> asyncio.Future[Any]:
        if isinstance(self._runner, ProcessRunner):
            return self._runner.submit(plan)  # the loop talks to the engine process itself
        return super()._launch(plan)

    def _detach(self, request_id: str) -> None:
        self._runner.detach(request_id)
        self._sched.released(request_id)  # its pages are back in the pool

    # ---- requests --------------------------------------------------------------------------
    async def prefill(self, request: GenerateRequest) -> PublishedPrefix:
        """Compute the prompt's KV into the pool and publish its full pages under
        ``request.session``: a role that conditions on the prompt (``DiTEngine``) matches the
        returned chain and reads those pages where they are. Only full pages are published."""
        if request.session is None:
            raise RequestError(
                "prefill publishes the prompt's pages under a session; give session=",
                field="session",
            )
        one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        stream = await self._submit(dataclasses.replace(request, sampling=one))
        async with contextlib.aclosing(self._deliver(stream)) as outs:
            async for _ in outs:  # one token; leaving returns once the pages are published
                pass
        seq = stream.seq
        full = min(seq.prompt_len, seq.num_computed) // self.page_tokens
        full = min(full, len(seq.slots))
        hashes = _chain(page_keys(seq, full, self.page_tokens)) if full else []
        return PublishedPrefix(request.session, tuple(hashes), full * self.page_tokens)

    # ---- segmented input (the paper's segmented emission, pipelined prefill) ---------------
    async def open(self, request: GenerateRequest, *, idle_timeout: float = 60.0) -> str:
        """Admit ``request`` with its input left open and return its request id.

        What the request holds is prefilled at once (after matching the session's cached
        prefix); ``feed`` appends further segments, each prefilled as soon as it arrives, and
        the last one closes the input, after which tokens are sampled and read with
        ``outputs``. An open request that is neither fed nor read for ``idle_timeout`` seconds
        is aborted (its caller is gone), so a cancelled producer never pins pool pages. Like
        ``generate``, it waits for a co-located pool to be decided.
        """
        if not idle_timeout > 0:
            raise RequestError("idle_timeout must be > 0 seconds", field="idle_timeout")
        await self._until_ready()
        stream = await self._admit(request, input_open=True)
        assert self._segments is not None  # built with the scheduler, before ready
        self._segments.watch(stream, idle_timeout)
        return stream.seq.request_id

    def feed(self, request_id: str, segment: Any, *, last: bool = False) -> int:
        """Append one input segment to an open request; returns the sequence's length after it.

        ``segment``: token ids, a ``(n, hidden_size)`` tensor of embedding rows, or a list of
        those. ``last=True`` closes the input. The segment joins the sequence between steps.
        """
        if self._segments is None:
            raise RequestError(
                f"request {request_id!r} has no open input (the engine has not started; "
                "open it with engine.open first)",
                field="request_id",
            )
        return self._segments.feed(request_id, segment, last=last)

    async def outputs(self, request_id: str) -> AsyncIterator[StepOutput]:
        """The ``StepOutput``s of an opened request (leaving the iterator aborts it)."""
        stream = self._streams.get(request_id)
        if stream is None or self._segments is None:
            raise RequestError(f"no open request {request_id!r}", field="request_id")
        self._segments.reading(request_id)
        async with contextlib.aclosing(self._deliver(stream)) as outs:  # closed with this one
            async for out in outs:
                yield out

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
            self._runner.attach(seq)
        except BaseException:
            self._streams.pop(seq.request_id, None)
            await self.kv_pool.release(seq.request_id)
            self._runner.detach(seq.request_id)
            raise
        if not params.greedy:
            self._runner.sample_with(seq.request_id, params)
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

    # ---- the step loop (EngineBase._run carries these out) --------------------------------
    async def _plan(self) -> StepPlan | None:
        plan = self._sched.schedule()
        await self._carry_out(plan)
        return plan if plan.items else None

    def _between_steps(self) -> None:
        assert self._segments is not None
        self._segments.apply()  # segments fed to open requests join them between steps

    def _apply(self, plan: StepPlan, tokens: list[int | None]) -> None:
        """Count the computed tokens and append the sampled ones; a sequence that ids or length
        end leaves the scheduler now, so it is never planned again. Detokenizing, stop strings
        and queueing to the caller wait for ``_emit``, which runs beside the next step."""
        for (seq, n), token in zip(plan.items, tokens, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted (or stopped by a stop string) while the step ran
            seq.num_computed += n
            if token is not None:
                reason = seq.append(token)
                if reason is not None:
                    self._sched.remove(seq)
                self._sampled.append((seq, token, reason))

    def _emit(self) -> bool:
        if not self._sampled:
            return False
        sampled, self._sampled = self._sampled, []
        for seq, token, reason in sampled:
            self._on_token(seq, token, reason)
        return True

    def _on_token(self, seq: Sequence, token: int, reason: str | None) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None or stream.closed:
            return  # aborted since the token was sampled
        out = stream.on_token(token, reason)
        if out.finished:
            # ids/length (already out of the scheduler) or a stop string (_finish takes it out;
            # the token its in-flight step samples is dropped)
            seq.finish_reason = out.finish_reason
            self._finish(stream, out)
        else:
            stream.push(out)

    async def _page_io(self, io: PageIO[Sequence]) -> None:
        """A ``PREEMPT`` (pages released, the sequence requeued) or a ``FAIL`` of the plan."""
        pool, seq = self.kv_pool, io.seq
        assert pool is not None
        if io.op is PageOp.PREEMPT:
            # Layer 1 makes this safe: the tokens stay on the host, the KV is recomputed.
            self.preemptions += 1
            await pool.release(seq.request_id)
            self._runner.detach_pages(seq.request_id)
            self._sched.preempted(seq)
            return
        self._fail(
            seq,
            EngineError(
                f"request {seq.request_id!r}: the KV pool cannot hold {len(seq.tokens)} tokens "
                f"even alone ({io.why}); raise the pool's capacity or shorten the prompt"
            ),
        )

    async def _on_release(self, stream: Stream) -> None:
        """A finished sequence's full pages become the session's chain; history recorded."""
        assert self.kv_pool is not None
        seq = stream.seq
        if stream.session is None:
            return
        full = min(seq.num_computed // self.page_tokens, len(seq.slots))
        if full:
            hashes = _chain(page_keys(seq, full, self.page_tokens))
            await self.kv_pool.publish(stream.session, hashes, seq.slots[:full])
        self.history.record(stream.session, seq.tokens, seq.embeds)

    def statistics(self) -> dict[str, int]:
        """Running/waiting sequences, sessions held and preemptions (observability)."""
        counts = self._running_counts()
        return {**counts, "sessions": len(self.history), "preemptions": self.preemptions}


def _chain(keys: list[list[int] | bytes]) -> list[str]:
    from omniflow.compute._pool import chain_hashes

    return chain_hashes(keys)
