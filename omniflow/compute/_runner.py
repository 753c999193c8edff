"""Turns a step plan into one forward pass and the sampled tokens.

>>> # runner = ModelRunner(model, kv); runner.attach(seq); tokens = runner.step(plan)

Runs on the engine's dedicated thread (``step``) or, with ``executor="process"``, in the
engine's own process (``_procrunner``), which feeds ``run`` the same ``StepItem``s; everything
that touches the pool's async API (alloc, match, publish, release) happens on the event loop
before and after. Each sequence's page views are built once when its slots are attached and
extended as it grows, so a step does no pool lookups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from omniflow.compute._kv import KvCache, L1Pages
from omniflow.compute._model import ForwardBatch, LlamaModel, SeqSlice
from omniflow.compute._request import SamplingParams
from omniflow.compute._sampling import make_generator, sample
from omniflow.compute._scheduler import StepPlan
from omniflow.compute._sequence import EMBED, Sequence

__all__ = ["ModelRunner", "StepItem", "step_items"]


class StepItem(NamedTuple):
    """One sequence's share of a step, in plain values (what crosses to an engine process)."""

    request_id: str
    start: int  #: tokens already computed (the chunk's first position)
    ids: list[int]  #: the chunk's token ids (0 where embedding rows go)
    embeds: list[tuple[int, torch.Tensor]]  #: (offset in the chunk, rows) of embedding rows
    samples: bool  #: a token is sampled after this chunk


def step_items(plan: StepPlan) -> list[StepItem]:
    """What each sequence of ``plan`` computes."""
    items = []
    for seq, n in plan.items:
        start = seq.num_computed
        ids = [0 if t == EMBED else t for t in seq.tokens[start : start + n]]
        embeds = seq.embed_rows(start, start + n) if seq.embeds else []
        items.append(StepItem(seq.request_id, start, ids, embeds, plan.samples(seq, n)))
    return items


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

    def __init__(self, model: LlamaModel, kv: KvCache | L1Pages) -> None:
        self.model = model  #: weights and forward
        self.kv = kv  #: the pool seam
        self._pages: dict[str, _Pages] = {}  #: request_id -> page views
        self._stores = kv.stores()  #: per layer the pool's L1 (k, v) arrays, if it has them
        #: request_id -> (sampling params, RNG) for sampled (non-greedy) requests
        self.sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}

    def attach(self, seq: Sequence) -> None:
        """Build views for slots added to ``seq`` since the last call."""
        self.attach_slots(seq.request_id, seq.slots)

    def attach_slots(self, request_id: str, slots: list[int]) -> None:
        """Build views for ``slots`` past those attached to ``request_id`` so far (slots only
        grow, until ``detach_pages``)."""
        pages = self._pages.get(request_id)
        if pages is None:
            pages = self._pages[request_id] = _Pages(len(self.kv.names))
        for slot in slots[pages.n :]:
            ks, vs = self.kv.views(slot)
            for layer in range(len(ks)):
                pages.k[layer].append(ks[layer])
                pages.v[layer].append(vs[layer])
        pages.n = len(slots)
        pages.block = self.kv.block(slots) if self._stores is not None else None
        pages.ids = pages.block.tolist() if pages.block is not None else None

    def attached(self, request_id: str) -> list[int] | None:
        """The L1 indices of ``request_id``'s attached pages (None: not attached, or not all
        local L1 pages)."""
        pages = self._pages.get(request_id)
        return None if pages is None else pages.ids

    def sample_with(self, request_id: str, params: SamplingParams) -> None:
        """Sample ``request_id``'s tokens with ``params`` (its RNG is made here; greedy needs
        no call)."""
        self.sampling[request_id] = (params, make_generator(params))

    def detach(self, request_id: str) -> None:
        """Forget a finished sequence (page views and RNG)."""
        self._pages.pop(request_id, None)
        self.sampling.pop(request_id, None)

    def detach_pages(self, request_id: str) -> None:
        """Forget a preempted sequence's page views; its RNG stays for when it resumes."""
        self._pages.pop(request_id, None)

    def step(self, plan: StepPlan) -> list[int | None]:
        """Run the plan; one sampled token per item (None for a chunk that samples nothing)."""
        return self.run(step_items(plan))

    def run(self, items: list[StepItem]) -> list[int | None]:
        """One forward pass over ``items``; a sampled token per item (None where none is)."""
        logits = self.model.forward(self._batch(items))
        params, gens = [], []
        for item in items:
            if item.samples:
                p, g = self.sampling.get(item.request_id, (_GREEDY, None))
                params.append(p)
                gens.append(g)
        tokens = iter(sample(logits, params, gens)) if params else iter(())
        return [next(tokens) if item.samples else None for item in items]

    def _batch(self, items: list[StepItem]) -> ForwardBatch:
        dev = self.model.device
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        embed_rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for item in items:
            start, n, base = item.start, len(item.ids), len(ids)
            ids.extend(item.ids)
            positions.extend(range(start, start + n))
            for offset, rows in item.embeds:
                embed_rows.extend(range(base + offset, base + offset + rows.shape[0]))
                embeds.append(rows)
            pages = self._pages[item.request_id]
            stores = self._stores if pages.block is not None else None
            seqs.append(
                SeqSlice(start, n, pages.k, pages.v, item.samples, stores, pages.block, pages.ids)
            )
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            seqs=seqs,
            embeds=torch.cat(embeds).to(dev) if embeds else None,
            embed_rows=torch.tensor(embed_rows, dtype=torch.long, device=dev) if embeds else None,
        )


_GREEDY = SamplingParams(temperature=0.0)
