"""Turns a step plan into one forward pass and the sampled tokens.

>>> # runner = ModelRunner(model, kv); runner.attach(seq); tokens = runner.step(plan)

Runs on the engine's dedicated thread (``step``); everything that touches the pool's async API
(alloc, match, publish, release) happens on the event loop before and after. Each sequence's
page views are built once when its slots are attached and extended as it grows, so a step does
no pool lookups.
"""

from __future__ import annotations

import torch

from omniflow.compute._kv import KvCache
from omniflow.compute._model import ForwardBatch, LlamaModel, SeqSlice
from omniflow.compute._request import SamplingParams
from omniflow.compute._sampling import sample
from omniflow.compute._scheduler import StepPlan
from omniflow.compute._sequence import EMBED, Sequence

__all__ = ["ModelRunner"]


class _Pages:
    __slots__ = ("block", "ids", "k", "n", "v")

    def __init__(self, layers: int) -> None:
        self.k: list[list[torch.Tensor]] = [[] for _ in range(layers)]  #: per layer, per page
        self.v: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.n = 0  #: slots attached so far
        self.block: torch.Tensor | None = None  #: L1 indices of the slots (None: use views)
        self.ids: list[int] | None = None  #: the same as Python ints


class ModelRunner:
    """The model plus the page views of every live sequence."""

    def __init__(self, model: LlamaModel, kv: KvCache) -> None:
        self.model = model  #: weights and forward
        self.kv = kv  #: the pool seam
        self._pages: dict[str, _Pages] = {}  #: request_id -> page views
        self._stores = kv.stores()  #: per layer the pool's L1 (k, v) arrays, if it has them
        #: request_id -> (sampling params, RNG) for sampled (non-greedy) requests
        self.sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}

    def attach(self, seq: Sequence) -> None:
        """Build views for slots added to ``seq`` since the last call."""
        pages = self._pages.get(seq.request_id)
        if pages is None:
            pages = self._pages[seq.request_id] = _Pages(len(self.kv.names))
        for slot in seq.slots[pages.n :]:
            ks, vs = self.kv.views(slot)
            for layer in range(len(ks)):
                pages.k[layer].append(ks[layer])
                pages.v[layer].append(vs[layer])
        pages.n = len(seq.slots)
        pages.block = self.kv.block(seq.slots) if self._stores is not None else None
        pages.ids = pages.block.tolist() if pages.block is not None else None

    def clear(self, slots: list[int]) -> None:
        """Zero freshly allocated pages: the positions a step has not written yet are read
        (masked) by batched decode attention, and the pool's memory may hold NaN patterns."""
        for slot in slots:
            ks, vs = self.kv.views(slot)
            for t in (*ks, *vs):
                t.zero_()

    def detach(self, request_id: str) -> None:
        """Forget a finished sequence (page views and RNG)."""
        self._pages.pop(request_id, None)
        self.sampling.pop(request_id, None)

    def detach_pages(self, request_id: str) -> None:
        """Forget a preempted sequence's page views; its RNG stays for when it resumes."""
        self._pages.pop(request_id, None)

    def step(self, plan: StepPlan) -> list[int | None]:
        """Run the plan; one sampled token per item (None for a chunk that samples nothing)."""
        batch = self._batch(plan)
        logits = self.model.forward(batch)
        wanted = [(s, plan.samples(s, n)) for s, n in plan.items]
        params, gens = [], []
        for seq, want in wanted:
            if want:
                p, g = self.sampling.get(seq.request_id, (_GREEDY, None))
                params.append(p)
                gens.append(g)
        tokens = iter(sample(logits, params, gens)) if params else iter(())
        return [next(tokens) if want else None for _, want in wanted]

    def _batch(self, plan: StepPlan) -> ForwardBatch:
        dev = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        embed_rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for seq, n in plan.items:
            start = seq.num_computed
            base = len(ids)
            chunk = seq.tokens[start : start + n]
            ids.extend(0 if t == EMBED else t for t in chunk)
            positions.extend(range(start, start + n))
            for offset, rows in seq.embed_rows(start, start + n):
                embed_rows.extend(range(base + offset, base + offset + rows.shape[0]))
                embeds.append(rows)
            pages = self._pages[seq.request_id]
            stores = self._stores if pages.block is not None else None
            seqs.append(
                SeqSlice(
                    start, n, pages.k, pages.v, plan.samples(seq, n), stores, pages.block, pages.ids
                )
            )
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            seqs=seqs,
            embeds=torch.cat(embeds).to(dev) if embeds else None,
            embed_rows=torch.tensor(embed_rows, dtype=torch.long, device=dev) if embeds else None,
        )


_GREEDY = SamplingParams(temperature=0.0)
