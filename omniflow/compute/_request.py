"""What a caller hands an engine and what it gets back.

>>> import omniflow as of
>>> req = of.GenerateRequest(prompt="Hello", session="s1",
...                          sampling=of.SamplingParams(max_new_tokens=8, temperature=0.0))
>>> req.sampling.greedy
True
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

from omniflow.compute._errors import RequestError

__all__ = ["GenerateRequest", "SamplingParams", "StepOutput"]

_ids = itertools.count()
_PREFIX = os.urandom(3).hex()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    ``temperature=0`` is greedy. ``top_k=0`` and ``top_p=1`` disable those filters. ``seed``
    makes a request's samples reproducible whatever else shares its batch. ``stop`` holds stop
    strings (the text ends before them); ``stop_token_ids`` end generation on those ids (the
    model's EOS ids always do unless ``ignore_eos``).
    """

    max_new_tokens: int = 256  #: at most this many generated tokens
    temperature: float = 1.0  #: 0 for greedy
    top_p: float = 1.0  #: nucleus mass kept, in (0, 1]
    top_k: int = 0  #: keep the k likeliest tokens; 0 keeps all
    seed: int | None = None  #: per-request RNG seed
    stop: tuple[str, ...] | str | None = None  #: stop strings
    stop_token_ids: tuple[int, ...] = ()  #: extra ids that end generation
    ignore_eos: bool = False  #: keep going past the model's EOS

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be >= 1", field="sampling.max_new_tokens")
        if self.temperature < 0:
            raise RequestError("temperature must be >= 0", field="sampling.temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p must be in (0, 1]", field="sampling.top_p")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0 (0 disables it)", field="sampling.top_k")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if self.stop is not None and any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty", field="sampling.stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


@dataclass(slots=True)
class GenerateRequest:
    """One generation. Give exactly one of ``prompt`` / ``input_ids`` (or neither with ``embeds``).

    - ``prompt``: text, or a list of chat messages (``{"role", "content"}``) rendered with the
      model's chat template.
    - ``input_ids``: token ids.
    - ``embeds``: hidden states from encoder roles, appended after the tokens: one 2-D tensor
      ``(n, hidden_size)`` or a list of segments, each a list of token ids or such a tensor.
    - ``session``: whose cached prefix may be reused (and under which the result is published).
    - ``step``: incremental matching. ``None``: the input is the whole sequence (full matching
      against the session's cached pages). ``k >= 0``: the session's history truncated to its
      first ``k`` positions, then the input appended. ``k < 0``: appended to the whole history.
    """

    prompt: str | list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    embeds: Any = None
    session: str | None = None
    step: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""  #: filled in when empty; the owner of the request's pages

    def __post_init__(self) -> None:
        if self.prompt is not None and self.input_ids is not None:
            raise RequestError("give prompt or input_ids, not both", field="prompt")
        if self.prompt is None and self.input_ids is None and self.embeds is None:
            raise RequestError(
                "a GenerateRequest needs prompt, input_ids or embeds", field="prompt"
            )
        if self.step is not None and self.session is None:
            raise RequestError(
                "step refers to a session's history; give session= as well", field="step"
            )
        if not self.request_id:
            self.request_id = f"gen-{_PREFIX}-{next(_ids)}"


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One generated token.

    ``text`` is the new text this token completes (may be empty while a multi-byte character or
    a possible stop string is pending). ``finished`` is True on the last output, which carries
    ``finish_reason``: ``"stop"`` (EOS, stop id or stop string) or ``"length"``.
    """

    token_id: int  #: the generated token
    text: str  #: text delta
    finished: bool  #: True on the last output of the request
    cached_tokens: int = 0  #: prompt tokens served from the pool instead of recomputed
    prompt_tokens: int = 0  #: length of the prompt (history included)
    index: int = 0  #: 0-based position among the generated tokens
    finish_reason: str | None = None  #: "stop" | "length" | "abort" on the last output
