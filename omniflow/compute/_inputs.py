"""A ``GenerateRequest`` turned into the sequence the engine computes: token ids plus
embedding segments, built on the session's history when ``step`` asks for it.

>>> # tokens, embeds = build_inputs(request, cfg, tokenizer, history)
"""

from __future__ import annotations

from typing import Any

import torch

from omniflow.compute._config import ModelConfig
from omniflow.compute._errors import RequestError
from omniflow.compute._request import GenerateRequest
from omniflow.compute._sequence import EMBED
from omniflow.compute._session import SessionHistory
from omniflow.compute._tokenizer import Tokenizer

__all__ = ["build_inputs"]


def build_inputs(
    request: GenerateRequest,
    cfg: ModelConfig,
    tok: Tokenizer | None,
    history: SessionHistory,
) -> tuple[list[int], dict[int, torch.Tensor]]:
    """(tokens with EMBED at embedding positions, start position -> embedding rows)."""
    if request.step is not None and request.session is not None:
        tokens, embeds = history.base(request.session, request.step)
        tokens = list(tokens)
    else:
        tokens, embeds = [], {}
    tokens.extend(_check_ids(_prompt_ids(request, tok), cfg, "input_ids", allow_embed=False))
    if request.embeds is not None:
        segments = request.embeds if isinstance(request.embeds, list) else [request.embeds]
        for i, seg in enumerate(segments):
            if isinstance(seg, torch.Tensor):
                rows = _check_rows(seg, cfg, i)
                embeds[len(tokens)] = rows
                tokens.extend([EMBED] * rows.shape[0])
            else:
                tokens.extend(_check_ids(list(seg), cfg, f"embeds[{i}]", allow_embed=False))
    if not tokens:
        raise RequestError("the request has no input tokens", field="prompt")
    return tokens, embeds


def _prompt_ids(request: GenerateRequest, tok: Tokenizer | None) -> list[int]:
    if request.input_ids is not None:
        return list(request.input_ids)
    if request.prompt is None:
        return []
    if tok is None:
        raise RequestError(
            "the model directory has no tokenizer.json; send input_ids instead of a prompt",
            field="prompt",
        )
    if isinstance(request.prompt, str):
        return tok.encode(request.prompt)
    return tok.apply_chat_template(_messages(request.prompt))


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise RequestError(
            "prompt must be a string or a list of chat messages {'role': ..., 'content': ...}",
            field="prompt",
        )
    return list(prompt)


def _check_rows(rows: torch.Tensor, cfg: ModelConfig, i: int) -> torch.Tensor:
    if rows.dim() != 2 or rows.shape[1] != cfg.hidden_size or rows.shape[0] == 0:
        raise RequestError(
            f"embeds[{i}] has shape {tuple(rows.shape)}; expected (n >= 1, {cfg.hidden_size}) "
            "hidden states for this model",
            field="embeds",
        )
    return rows.detach().to("cpu")


def _check_ids(ids: list[int], cfg: ModelConfig, field: str, *, allow_embed: bool) -> list[int]:
    bad = [t for t in ids if not (0 <= t < cfg.vocab_size or (allow_embed and t == EMBED))]
    if bad:
        raise RequestError(
            f"{field} holds ids outside the vocabulary (0..{cfg.vocab_size - 1}): {bad[:5]}",
            field=field,
        )
    return ids
