"""The Realtime session (``_realtime``): its configuration, conversation and input audio buffer,
each client event checked and applied with no I/O.

>>> session = RealtimeSession("voice_chat")
>>> session.update({"output_modalities": ["text"]})
>>> session.create_item({"role": "user", "content": [{"type": "input_text", "text": "hi"}]})["role"]
'user'
>>> session.messages()
[{'role': 'user', 'content': 'hi'}]
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass, field
from typing import Any

from omniflow._media import Audio
from omniflow.serve._pcm import PCM16_RATE

__all__ = ["RealtimeError", "RealtimeSession", "new_id", "pcm_rate", "public_item"]


class RealtimeError(Exception):
    """A client event the session refuses: sent back as an ``error`` event."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(slots=True)
class RealtimeSession:
    """What one connection holds between events; each method checks one client event and
    changes the session (raising ``RealtimeError`` without changing it when refused)."""

    #: The graph serving the session.
    model: str
    #: The session's id (``sess_...``).
    id: str = field(default_factory=lambda: new_id("sess"))
    #: ``["audio"]`` (audio + transcript) or ``["text"]``.
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    #: A system message put first, when not empty.
    instructions: str = ""
    #: The voice the graph's ``voice`` Placeholder receives.
    voice: str = "alloy"
    #: Sample rate of ``input_audio_buffer.append`` audio.
    input_rate: int = PCM16_RATE
    #: ``max_output_tokens`` as the graph's ``max_tokens`` (None: the graph's default).
    max_tokens: int | None = None
    #: Conversation items (``{"id", "type", "role", "content"}``), oldest first; user audio
    #: parts hold an ``of.Audio`` under ``"audio"``.
    items: list[dict[str, Any]] = field(default_factory=list)
    #: 16-bit PCM appended since the last commit or clear.
    buffer: bytearray = field(default_factory=bytearray)

    def config(self) -> dict[str, Any]:
        """The session object of ``session.created`` / ``session.updated``."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": self.id,
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "max_output_tokens": self.max_tokens if self.max_tokens is not None else "inf",
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": self.input_rate},
                    "turn_detection": None,
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": PCM16_RATE},
                    "voice": self.voice,
                },
            },
        }

    def update(self, session: Any) -> None:
        """``session.update``: GA fields, and the beta names of the same settings."""
        if not isinstance(session, dict):
            raise RealtimeError("invalid_value", "'session' must be an object", "session")
        new: dict[str, Any] = {}
        mods = session.get("output_modalities", session.get("modalities"))
        if mods is not None:
            if not isinstance(mods, list) or not mods or not set(mods) <= {"text", "audio"}:
                raise RealtimeError(
                    "invalid_value",
                    f"output_modalities must be ['audio'] or ['text'], got {mods!r}",
                    "session.output_modalities",
                )
            new["output_modalities"] = ["audio"] if "audio" in mods else ["text"]
        if session.get("instructions") is not None:
            if not isinstance(session["instructions"], str):
                raise RealtimeError(
                    "invalid_type", "instructions must be a string", "session.instructions"
                )
            new["instructions"] = session["instructions"]
        tokens = session.get("max_output_tokens", session.get("max_response_output_tokens"))
        if tokens is not None:
            if tokens == "inf":
                new["max_tokens"] = None
            elif isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1:
                new["max_tokens"] = tokens
            else:
                raise RealtimeError(
                    "invalid_value",
                    "max_output_tokens must be >= 1 or 'inf'",
                    "session.max_output_tokens",
                )
        audio = session.get("audio") or {}
        inp, out = audio.get("input") or {}, audio.get("output") or {}
        if session.get("turn_detection", inp.get("turn_detection")) is not None:
            raise RealtimeError(
                "unsupported_value",
                "server VAD is not offered: set turn_detection to null and commit each turn "
                "with input_audio_buffer.commit",
                "session.audio.input.turn_detection",
            )
        voice = out.get("voice", session.get("voice"))
        if voice is not None:
            if not isinstance(voice, str):
                raise RealtimeError(
                    "invalid_type", "voice must be a string", "session.audio.output.voice"
                )
            new["voice"] = voice
        fmt_in = inp.get("format", session.get("input_audio_format"))
        if fmt_in is not None:
            new["input_rate"] = pcm_rate(fmt_in, "session.audio.input.format", any_rate=True)
        fmt_out = out.get("format", session.get("output_audio_format"))
        if fmt_out is not None:
            pcm_rate(fmt_out, "session.audio.output.format", any_rate=False)
        for key, value in new.items():
            setattr(self, key, value)

    def append(self, audio: Any, limit: int) -> None:
        """``input_audio_buffer.append``: base64 16-bit PCM at the session's input rate."""
        if not isinstance(audio, str):
            raise RealtimeError("invalid_type", "audio must be a base64 string", "audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RealtimeError(
                "invalid_value", f"audio is not valid base64 ({exc})", "audio"
            ) from None
        if len(self.buffer) + len(data) > limit:
            raise RealtimeError(
                "input_audio_buffer_too_large",
                f"the input audio buffer would hold over {limit} bytes (--max-body-mb); "
                "commit or clear it first",
                "audio",
            )
        self.buffer += data

    def commit(self) -> dict[str, Any]:
        """``input_audio_buffer.commit``: the buffer becomes a user item (returned)."""
        import numpy as np

        if not self.buffer:
            raise RealtimeError(
                "input_audio_buffer_commit_empty",
                "the input audio buffer is empty: append audio before committing",
            )
        if len(self.buffer) % 2:
            raise RealtimeError(
                "invalid_value",
                f"the input audio buffer holds {len(self.buffer)} bytes, not whole 16-bit samples",
            )
        samples = np.frombuffer(bytes(self.buffer), dtype="<i2").astype(np.int16)
        self.buffer.clear()
        clip = Audio(samples, sample_rate=self.input_rate)
        part = {"type": "input_audio", "audio": clip, "transcript": None}
        return self._add({"type": "message", "role": "user", "content": [part]})

    def create_item(self, item: Any) -> dict[str, Any]:
        """``conversation.item.create`` of a message (returned as stored)."""
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise RealtimeError(
                "unsupported_value", "only items of type 'message' are taken", "item.type"
            )
        role = item.get("role")
        if role not in ("user", "assistant", "system"):
            raise RealtimeError(
                "invalid_value",
                f"item.role must be user, assistant or system, got {role!r}",
                "item.role",
            )
        content = item.get("content")
        if not isinstance(content, list):
            raise RealtimeError("invalid_type", "item.content must be an array", "item.content")
        parts: list[dict[str, Any]] = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"item.content[{i}]"
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": kind, "text": part["text"]})
            elif kind == "input_audio" and role == "user":
                import numpy as np

                try:
                    data = base64.b64decode(part.get("audio") or "", validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise RealtimeError(
                        "invalid_value",
                        f"{where}.audio is not valid base64 ({exc})",
                        f"{where}.audio",
                    ) from None
                if not data or len(data) % 2:
                    raise RealtimeError(
                        "invalid_value",
                        f"{where}.audio must be whole 16-bit PCM samples",
                        f"{where}.audio",
                    )
                clip = Audio(np.frombuffer(data, "<i2").astype(np.int16), self.input_rate)
                parts.append({"type": "input_audio", "audio": clip, "transcript": None})
            else:
                raise RealtimeError(
                    "invalid_value",
                    f"{where}: a part of type {kind!r} is not "
                    "taken (input_text, input_audio, text)",
                    where,
                )
        stored = {"type": "message", "role": role, "content": parts}
        if isinstance(item.get("id"), str):
            stored["id"] = item["id"]
        return self._add(stored)

    def add_answer(self, text: str) -> dict[str, Any]:
        """The assistant's answer joins the conversation."""
        part = {
            "type": "output_audio" if self.audio_out else "output_text",
            "transcript" if self.audio_out else "text": text,
        }
        return self._add({"type": "message", "role": "assistant", "content": [part]})

    def _add(self, item: dict[str, Any]) -> dict[str, Any]:
        item.setdefault("id", new_id("item"))
        item["object"] = "realtime.item"
        item["status"] = "completed"
        self.items.append(item)
        return item

    def previous_id(self, item: dict[str, Any]) -> str | None:
        """The id of the item before ``item`` (None for the first)."""
        i = self.items.index(item)
        return self.items[i - 1]["id"] if i else None

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat ``messages`` (audio parts carry an ``of.Audio``)."""
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        for item in self.items:
            texts, media = [], []
            for part in item["content"]:
                if "audio" in part and isinstance(part["audio"], Audio):
                    media.append({"type": "input_audio", "input_audio": part["audio"]})
                else:
                    texts.append(part.get("text") or part.get("transcript") or "")
            if not media:
                out.append({"role": item["role"], "content": "".join(texts)})
            else:
                parts = [{"type": "text", "text": t} for t in texts if t] + media
                out.append({"role": item["role"], "content": parts})
        return out


def pcm_rate(fmt: Any, param: str, *, any_rate: bool) -> int:
    """The rate of an ``audio/pcm`` format (GA object, or beta ``"pcm16"``)."""
    if fmt == "pcm16":
        return PCM16_RATE
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    rate = fmt.get("rate", PCM16_RATE) if isinstance(fmt, dict) else None
    if kind != "audio/pcm":
        raise RealtimeError(
            "unsupported_value",
            f"{param}: only 'audio/pcm' (16-bit PCM) is offered, got {fmt!r}",
            param,
        )
    if not isinstance(rate, int) or isinstance(rate, bool) or rate <= 0:
        raise RealtimeError("invalid_value", f"{param}.rate must be a positive integer", param)
    if not any_rate and rate != PCM16_RATE:
        raise RealtimeError(
            "unsupported_value", f"{param}.rate: output audio is {PCM16_RATE} Hz", param
        )
    return rate


def public_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item as sent to the client (audio bytes left out, as OpenAI's echoes do)."""
    content = [
        {k: (None if isinstance(v, Audio) else v) for k, v in part.items()}
        for part in item["content"]
    ]
    return {**item, "content": content}
