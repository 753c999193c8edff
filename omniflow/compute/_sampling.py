"""Choosing the next token, and watching the text for stop strings.

>>> import torch
>>> from omniflow.compute._request import SamplingParams
>>> sample(torch.tensor([[0.1, 2.0, 0.3]]), [SamplingParams(temperature=0.0)], [None])
[1]

Greedy rows take the argmax on the model's device in one call. Sampled rows are drawn on the host
from the request's own ``torch.Generator``, so a seeded request gives the same tokens whatever
shares its batch and whichever device runs the model.
"""

from __future__ import annotations

import os

import torch

from omniflow.compute._request import SamplingParams

__all__ = ["StopWatch", "make_generator", "sample"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's RNG (None for greedy); seeded from ``params.seed`` or from the OS."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    g.manual_seed(seed)
    return g


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits`` (N, vocab) float32."""
    out: list[int] = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _draw(logits[i].cpu(), p, generators[i])
    return out


def _draw(row: torch.Tensor, p: SamplingParams, g: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k and p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        row = row.scatter(0, order[drop], float("-inf"))
    probs = row.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=g).item())


class StopWatch:
    """Holds back text that might be the start of a stop string; cuts the text at one.

    >>> w = StopWatch(("END",))
    >>> w.feed("hello E"), w.feed("N"), w.feed("D and more")
    (('hello ', False), ('', False), ('', True))
    """

    __slots__ = ("_held", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops  #: the stop strings
        self._held = ""  #: text not yet released (a possible stop-string prefix)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return delta, False
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        keep = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held text, at the end of a generation that did not stop on a string."""
        text, self._held = self._held, ""
        return text
