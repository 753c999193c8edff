"""Which OpenAI endpoints a graph serves, by its shape (docs/contract.md §9's table).

>>> endpoints_of(inputs=("input", "voice"), outputs=("audio",))
['audio.speech']

Pure code: a graph serves an endpoint when it has the endpoint's required Placeholders and
outputs. When a request runs the graph, every Placeholder the request does not fill gets None
if it is one the table names for *any* endpoint (an optional input there, or another
endpoint's required one: ``voice_chat`` takes ``messages``, ``input`` and ``audio`` and serves
chat, speech and transcriptions, each request filling the one it sends); any other Placeholder
must come from a request field of the same name (``extra_body``), else the call is a 400.

    endpoint                      required inputs   required outputs   optional inputs
    chat.completions, realtime    messages          text               modalities, voice,
                                                                       audio_format, OpenAI's
    audio.speech                  input             (any)              voice, speed, instructions
    audio.transcriptions          audio             text               language, prompt
    images.generations            prompt            (any)              size, n

A graph that serves transcriptions does not serve images: its ``prompt`` is the transcription's
hint (OpenAI's ``prompt`` field there), not a picture's description.

Which output carries the audio (speech, chat with audio) or the images: the frames whose value
is an ``of.Audio`` / ``of.Image``, whatever their field; the shape cannot tell statically.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from omniflow.serve._chat_request import OPENAI_FIELDS

__all__ = ["KNOWN_INPUTS", "Endpoint", "endpoints_of", "graph_inputs", "served"]


class Endpoint(enum.Enum):
    """An OpenAI endpoint: value = (name in ``/v1/models``, required inputs, required outputs,
    optional inputs)."""

    CHAT = ("chat.completions", ("messages",), ("text",), ("modalities", "voice", "audio_format"))
    SPEECH = ("audio.speech", ("input",), (), ("voice", "speed", "instructions"))
    TRANSCRIPTIONS = ("audio.transcriptions", ("audio",), ("text",), ("language", "prompt"))
    IMAGES = ("images.generations", ("prompt",), (), ("size", "n"))
    REALTIME = ("realtime", ("messages",), ("text",), ("modalities", "voice", "audio_format"))

    @property
    def label(self) -> str:
        name: str = self.value[0]
        return name

    @property
    def required(self) -> tuple[str, ...]:
        req: tuple[str, ...] = self.value[1]
        return req

    @property
    def optional(self) -> tuple[str, ...]:
        opt: tuple[str, ...] = self.value[3]
        return opt

    def fits(self, inputs: Collection[str], outputs: Collection[str]) -> bool:
        """Whether a graph with these Placeholders and outputs serves this endpoint."""
        needed_out: tuple[str, ...] = self.value[2]
        return (
            all(i in inputs for i in self.required)
            and all(o in outputs for o in needed_out)
            and bool(outputs)
        )


#: OpenAI's optional chat fields that may be graph inputs (``max_tokens``, ``temperature``...).
_CHAT_OPTIONAL = OPENAI_FIELDS - {"model", "messages", "stream", "stream_options"}

#: Placeholders that get None when a request leaves them out (see the module docstring).
KNOWN_INPUTS = frozenset(
    {name for e in Endpoint for name in (*e.required, *e.optional)} | _CHAT_OPTIONAL
)


def served(plans: Mapping[str, Any], endpoint: Endpoint) -> list[str]:
    """Names of the graphs of ``plans`` (name -> Plan, with ``inputs``/``outputs``) that serve
    ``endpoint``."""
    return [n for n, p in plans.items() if _serves(endpoint, p.inputs, p.outputs)]


def endpoints_of(inputs: Collection[str], outputs: Collection[str]) -> list[str]:
    """The labels of every endpoint a graph of this shape serves."""
    return [e.label for e in Endpoint if _serves(e, inputs, outputs)]


def _serves(endpoint: Endpoint, inputs: Collection[str], outputs: Collection[str]) -> bool:
    if endpoint is Endpoint.IMAGES and Endpoint.TRANSCRIPTIONS.fits(inputs, outputs):
        return False
    return endpoint.fits(inputs, outputs)


def graph_inputs(
    placeholders: Iterable[str], given: Mapping[str, Any], *, skip: Collection[str] = ()
) -> dict[str, Any]:
    """The call's inputs: ``given[name]`` for each Placeholder the request fills, None for a
    ``KNOWN_INPUTS`` one it leaves out; a Placeholder neither fills is left out (the call then
    fails with an ``InputError`` naming it). ``skip``: request fields that never reach a graph."""
    inputs: dict[str, Any] = {}
    for name in placeholders:
        if name in skip:
            continue
        if name in given:
            inputs[name] = given[name]
        elif name in KNOWN_INPUTS:
            inputs[name] = None
    return inputs
