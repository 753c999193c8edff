"""``DiTEngine``: image denoising on the LLM path, an ``EngineBase`` like ``TorchEngine``.

>>> # llm = TorchEngine(llm_dir, pool=kv); dit = DiTEngine(dit_dir, pool=kv)   # one pool
>>> # prefix = await llm.prefill(GenerateRequest(prompt="a cat", session="s1"))
>>> # async for out in dit.generate(DenoiseRequest(context=prefix, steps=8, preview_every=4)):
>>> #     out.latents   # a preview every 4 steps, then the final latents (out.finished)

Same weight loading (a safetensors directory whose config names ``OmniflowDiT``), same pool
access, same step loop as ``TorchEngine`` (``EngineBase``). A request names the LLM's published
prompt chain (``PublishedPrefix``); admission matches it in the pool under the request's id, so
the prompt's pages are pinned, not copied, and become the first pages of the picture's sequence.
Each loop iteration carries out the pool I/O the ``DenoiseScheduler`` planned (a picture's own
pages at its first step; one the pool cannot hold yet waits, or fails when it cannot fit even
alone) and runs one denoising step of every running picture as one forward pass (pictures
arriving meanwhile join at the next step).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch

from omniflow.compute._base import EngineBase, EngineOptions
from omniflow.compute._dit import ARCH, DitConfig, DitModel, load_dit
from omniflow.compute._dit_sched import DenoisePlan, DenoiseScheduler, DitSeq, StepKind
from omniflow.compute._engine import PublishedPrefix
from omniflow.compute._errors import EngineError, RequestError
from omniflow.compute._kv import KvCache, PagePool
from omniflow.compute._model import ForwardBatch, SeqSlice
from omniflow.compute._outbox import Outbox
from omniflow.compute._pages import PageIO, PageOp
from omniflow.compute._sequence import EMBED, SeqStatus

__all__ = ["DenoiseOutput", "DenoiseRequest", "DiTEngine", "DitRunner"]

_ids = itertools.count()
_PREFIX = os.urandom(3).hex()


@dataclass(slots=True)
class DenoiseRequest:
    """One picture. ``context``: the LLM's published prompt (``TorchEngine.prefill``'s result, or
    its ``as_dict()``); None denoises unconditioned. The starting noise is ``noise``
    (``(num_tokens, latent_dim)``) or drawn from ``seed``. ``preview_every`` > 0 streams the
    latents after every that many steps (not after the last, which is the final output)."""

    context: PublishedPrefix | Mapping[str, Any] | None = None
    steps: int = 8  #: Euler steps from t=1 to t=0
    preview_every: int = 0  #: 0: no previews
    seed: int = 0  #: noise seed when ``noise`` is None
    noise: torch.Tensor | None = None  #: the starting latents
    request_id: str = ""  #: filled in when empty; the owner of the picture's pages

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise RequestError(f"steps must be an int >= 1, got {self.steps!r}", field="steps")
        if not isinstance(self.preview_every, int) or self.preview_every < 0:
            raise RequestError(
                f"preview_every must be an int >= 0 (0: no previews), got {self.preview_every!r}",
                field="preview_every",
            )
        if isinstance(self.context, Mapping):
            self.context = _prefix(self.context)
        elif self.context is not None and not isinstance(self.context, PublishedPrefix):
            raise RequestError(
                f"context must be a PublishedPrefix (TorchEngine.prefill's result) or its "
                f"as_dict(), got {type(self.context).__name__}",
                field="context",
            )
        if not self.request_id:
            self.request_id = f"dit-{_PREFIX}-{next(_ids)}"


def _prefix(raw: Mapping[str, Any]) -> PublishedPrefix:
    missing = [k for k in ("session", "hashes", "tokens") if k not in raw]
    if missing:
        raise RequestError(
            f"context lacks {missing}; pass TorchEngine.prefill's result or its as_dict()",
            field="context",
        )
    hashes = raw["hashes"]
    if isinstance(hashes, str | bytes) or not all(isinstance(h, str) for h in hashes):
        raise RequestError("context.hashes must be a list of chain hashes", field="context.hashes")
    return PublishedPrefix(raw["session"], tuple(hashes), int(raw["tokens"]))


@dataclass(frozen=True, slots=True)
class DenoiseOutput:
    """A preview (``finished`` False) or the final latents of one picture."""

    step: int  #: steps taken when these latents were produced
    steps: int  #: steps in all
    latents: torch.Tensor  #: (num_tokens, latent_dim)
    finished: bool  #: True on the last output
    context_tokens: int = 0  #: prompt positions the picture attended to (read in place)
    finish_reason: str | None = None  #: "length" on the last output


class DitRunner:
    """The DiT plus the page views of every live picture; ``step`` runs on the engine thread."""

    def __init__(self, model: DitModel, kv: KvCache) -> None:
        self.model = model  #: weights and forward
        self.kv = kv  #: the pool seam
        self._stores = kv.stores()  #: per layer the pool's L1 (k, v) arrays, if it has them
        #: request_id -> (per layer page views of k, of v, L1 block or None)
        self._views: dict[
            str, tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], torch.Tensor | None]
        ] = {}

    def attach(self, seq: DitSeq) -> None:
        """Views of all of ``seq``'s pages (context and own), built once."""
        layers = len(self.kv.names)
        k: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        v: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        for slot in seq.slots:
            ks, vs = self.kv.views(slot)
            for layer in range(layers):
                k[layer].append(ks[layer])
                v[layer].append(vs[layer])
        block = self.kv.block(seq.slots) if self._stores is not None else None
        self._views[seq.request_id] = (k, v, block)

    def detach(self, request_id: str) -> None:
        self._views.pop(request_id, None)

    def step(self, seqs: list[DitSeq]) -> list[torch.Tensor]:
        """One Euler step of every picture, as one forward pass; their new latents."""
        model = self.model
        dev = model.device
        slices: list[SeqSlice] = []
        positions: list[torch.Tensor] = []
        times: list[torch.Tensor] = []
        deltas: list[torch.Tensor] = []
        for seq in seqs:
            k, v, block = self._views[seq.request_id]
            stores = self._stores if block is not None else None
            n = seq.num_tokens
            slices.append(SeqSlice(seq.context_len, n, k, v, False, stores, block))
            positions.append(torch.arange(seq.context_len, seq.context_len + n))
            t, t_next = seq.timesteps()
            times.append(torch.full((n,), t))
            deltas.append(torch.full((n, 1), t_next - t))
        latents = torch.cat([s.latents for s in seqs]).to(dev)
        batch = ForwardBatch(
            input_ids=torch.full((latents.shape[0],), EMBED, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            seqs=slices,
            extra={"latents": latents, "timesteps": torch.cat(times).to(dev)},
        )
        velocity = model.forward(batch)
        x = latents + torch.cat(deltas).to(dev, latents.dtype) * velocity
        out, row = [], 0
        for seq in seqs:
            out.append(x[row : row + seq.num_tokens])
            row += seq.num_tokens
        return out


class DiTEngine(EngineBase[DenoiseRequest, DenoiseOutput, Outbox[DitSeq]]):
    """A batching denoising engine whose attention reads the LLM's KV pages in its pool.

    ``pool``: the LLM's pool (a ``ParamsPool``, a graph pool name, or a
    ``KvPoolBarrier.member(...)`` seat); None gives a private pool (unconditioned pictures
    only, since no LLM writes there).
    """

    architectures = frozenset({ARCH})
    _sched: DenoiseScheduler  #: the pure batching and page decisions, once started
    _runner: DitRunner  #: the DiT and the pictures' page views, once started

    def __init__(self, model_dir: str | Path, **options: Unpack[EngineOptions]) -> None:
        options.setdefault("max_batch", 8)  # the DiT engine's own defaults
        options.setdefault("pool_pages", 1024)
        super().__init__(model_dir, **options)
        self.config: DitConfig | None = None  #: the DiT's shape once started

    # ---- EngineBase hooks ------------------------------------------------------------------
    def _load_model(self) -> DitModel:
        return load_dit(
            self.model_dir, device=self.device, dtype=self.dtype, share=self.share_weights
        )

    def _loaded(self, model: Any) -> None:
        self.config = model.cfg

    def _build(self, model: Any, pool: PagePool) -> DenoiseScheduler:
        self._runner = DitRunner(model, self._kv)
        self._sched = DenoiseScheduler(
            max_batch=self.max_batch,
            page_tokens=self.page_tokens,
            # A private pool is this engine's alone: its pages are the budget. A pool shared
            # with the LLM keeps pages the DiT cannot see; its refusals are reported as they come.
            budget=self.pool_pages if self._own_pool else None,
        )
        return self._sched

    def _plan_ids(self, plan: DenoisePlan) -> set[str]:
        return {s.request_id for s in plan.items}

    def _plan_seqs(self, plan: DenoisePlan) -> list[DitSeq]:
        return plan.items

    def _step(self, plan: DenoisePlan) -> list[torch.Tensor]:
        return self._runner.step(plan.items)

    def _detach(self, request_id: str) -> None:
        self._runner.detach(request_id)
        self._sched.released(request_id)  # its pages are back in the pool

    # ---- requests --------------------------------------------------------------------------
    async def _admit(self, request: DenoiseRequest) -> Outbox[DitSeq]:
        assert self.config is not None and self.kv_pool is not None
        cfg, rid = self.config, request.request_id
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already running", field="request_id")
        model = self._runner.model
        noise = self._noise(request, cfg).to(model.device, model.dtype)
        seq = DitSeq(rid, noise, steps=request.steps, preview_every=request.preview_every)
        stream: Outbox[DitSeq] = Outbox(seq)
        self._streams[rid] = stream
        try:
            await self._match_context(seq, request.context)
        except BaseException:
            self._streams.pop(rid, None)
            await self.kv_pool.release(rid)
            raise
        self._sched.add(seq)
        self._wake.set()
        return stream

    def _noise(self, request: DenoiseRequest, cfg: DitConfig) -> torch.Tensor:
        shape = (cfg.num_tokens, cfg.latent_dim)
        if request.noise is None:
            gen = torch.Generator().manual_seed(request.seed)
            return torch.randn(*shape, generator=gen)
        noise = request.noise
        if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != shape:
            got = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise RequestError(
                f"noise has shape {got}; this DiT denoises {shape} (num_tokens, latent_dim)",
                field="noise",
            )
        return noise.detach().to("cpu", torch.float32).clone()

    async def _match_context(self, seq: DitSeq, ctx: Any) -> None:
        """Pin the prompt's pages under the picture's id: they become its first pages."""
        if ctx is None or not ctx.hashes:
            return
        pool = self.kv_pool
        assert pool is not None
        n = len(ctx.hashes)
        if ctx.tokens != n * self.page_tokens:
            raise RequestError(
                f"context holds {ctx.tokens} positions in {n} pages, but pages of pool "
                f"{getattr(pool, 'name', '?')!r} hold {self.page_tokens} tokens; the DiT must "
                "share the LLM's pool",
                field="context.tokens",
            )
        match = await pool.match(ctx.session, list(ctx.hashes), seq.request_id)
        if int(match.pages) < n:
            raise EngineError(
                f"request {seq.request_id!r}: only {int(match.pages)} of the {n} context pages "
                f"of session {ctx.session!r} are in pool {getattr(pool, 'name', '?')!r} (not "
                "published there, or evicted before the DiT matched them); share the LLM's pool, "
                "prefill again, or give the pool more capacity"
            )
        seq.slots = list(match.slots[:n])
        seq.context_len = ctx.tokens

    # ---- the step loop (EngineBase._run carries these out) --------------------------------
    async def _plan(self) -> DenoisePlan | None:
        """Every running picture's next step, after the pool I/O its scheduler decided."""
        plan = self._sched.schedule()
        await self._carry_out(plan)
        return plan if plan.items else None

    async def _page_io(self, io: PageIO[DitSeq]) -> None:
        """A ``FAIL`` (the DiT's scheduler never preempts: a picture keeps its pages)."""
        assert io.op is PageOp.FAIL, io
        seq = io.seq
        self._fail(
            seq,
            EngineError(
                f"request {seq.request_id!r}: the KV pool cannot hold the picture's "
                f"{seq.num_tokens} image tokens ({self._sched.own_pages(seq)} pages) next to its "
                f"context even alone ({io.why}); raise the pool's capacity"
            ),
        )

    def _apply(self, plan: DenoisePlan, latents: list[torch.Tensor]) -> None:
        for seq, x in zip(plan.items, latents, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue  # aborted while the step ran
            kind = seq.advance(x)
            if kind is StepKind.STEP:
                continue
            out = DenoiseOutput(
                step=seq.done,
                steps=seq.steps,
                latents=x,
                finished=kind is StepKind.FINAL,
                context_tokens=seq.context_len,
                finish_reason=seq.finish_reason if kind is StepKind.FINAL else None,
            )
            stream = self._streams[seq.request_id]
            if kind is StepKind.FINAL:
                self._finish(stream, out)
            else:
                stream.push(out)

    def statistics(self) -> dict[str, int]:
        """Running/waiting pictures and forward passes run (observability)."""
        return self._running_counts()
