"""Media in requests, checked at the edge: base64, ``data:`` URLs, WAV and image bytes.

>>> decode_messages([{"role": "user", "content": [{"type": "image_url",
...     "image_url": {"url": "https://example.com/cat.png"}}]}])
Traceback (most recent call last):
...
omniflow.serve._media_in.BadMedia: messages[0].content[0].image_url.url: a remote URL ...

A chat message part ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``
reaches the graph as ``{"type": "image_url", "image_url": of.Image}`` and ``{"type":
"input_audio", "input_audio": {"data": b64, "format": "wav"}}`` as ``{"type": "input_audio",
"input_audio": of.Audio}``: the payload replaced, the rest of the message as sent, the media as
sent (no resampling). Only ``data:`` URLs are taken: the server fetches nothing (an ``http(s)``
URL is refused, naming the part). Undecodable base64, WAV or image bytes are a ``BadMedia``
naming the part (the routes answer 400 with it as ``param``).

WAV files written as a stream (their RIFF and data sizes 0xFFFFFFFF or 0, what a streamed
``/v1/audio/speech`` answer and ``ffmpeg ... -f wav -`` write) are read up to their end; a WAV
whose honest header promises more data than it holds is truncated, and refused.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Any

from omniflow._exceptions import MediaError
from omniflow._media import Audio, Image

__all__ = ["BadMedia", "decode_audio", "decode_b64", "decode_image_url", "decode_messages"]


class BadMedia(ValueError):
    """Media the request carries cannot be decoded; ``param`` names the part."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        #: The part, as OpenAI writes params (``messages[0].content[1].input_audio.data``).
        self.param = param
        #: What is wrong with it.
        self.message = f"{param}: {message}"


def decode_b64(data: Any, param: str) -> bytes:
    """Strict base64 (standard alphabet, padding optional) -> bytes, or ``BadMedia``."""
    if not isinstance(data, str):
        raise BadMedia(param, f"expected a base64 string, got {type(data).__name__}")
    text = "".join(data.split())
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadMedia(param, f"not valid base64 ({exc})") from None


def _unstreamed(data: bytes) -> bytes:
    """A streamed WAV (sizes 0xFFFFFFFF or 0) with its sizes set to what it holds."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return data
    riff = struct.unpack_from("<I", data, 4)[0]
    if riff not in (0, 0xFFFFFFFF):
        return data
    out = bytearray(data)
    struct.pack_into("<I", out, 4, len(data) - 8)
    pos = 12
    while pos + 8 <= len(out):
        chunk, size = out[pos : pos + 4], struct.unpack_from("<I", out, pos + 4)[0]
        if chunk == b"data":
            if size in (0, 0xFFFFFFFF) or pos + 8 + size > len(out):
                held = len(out) - pos - 8
                struct.pack_into("<I", out, pos + 4, held - held % 2)
            break
        pos += 8 + size + (size & 1)
    return bytes(out)


def decode_audio(data: bytes, param: str) -> Audio:
    """WAV bytes -> ``of.Audio``, or ``BadMedia`` naming ``param``."""
    try:
        return Audio.from_bytes(_unstreamed(data))
    except MediaError as exc:
        raise BadMedia(param, str(exc)) from None


def decode_image(data: bytes, param: str) -> Image:
    """PNG/JPEG bytes -> ``of.Image``, or ``BadMedia`` naming ``param``."""
    try:
        return Image.from_bytes(data)
    except MediaError as exc:
        raise BadMedia(param, str(exc)) from None


def decode_image_url(url: str, param: str) -> Image:
    """A ``data:image/...;base64,...`` URL -> ``of.Image``; any other URL is ``BadMedia``."""
    scheme = url[:8].lower()
    if scheme.startswith(("http://", "https://")):
        raise BadMedia(
            param,
            "a remote URL; this server fetches nothing: send the image inline as "
            "'data:image/png;base64,...'",
        )
    if not scheme.startswith("data:"):
        raise BadMedia(param, "expected a 'data:image/png;base64,...' URL")
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise BadMedia(param, "expected a base64 data URL ('data:image/png;base64,...')")
    return decode_image(decode_b64(payload, param), param)


def decode_messages(messages: list[Any]) -> list[Any]:
    """``messages`` (already validated by ``_chat_request``) with each ``image_url`` and
    ``input_audio`` part's payload decoded; the input is not modified. ``BadMedia`` names the
    first part that cannot be decoded."""
    out: list[Any] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            path = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "image_url":
                url = part["image_url"]["url"]
                pic = decode_image_url(url, f"{path}.image_url.url")
                part = {**part, "image_url": pic}
            elif kind == "input_audio":
                audio = part["input_audio"]
                if audio.get("format") != "wav":
                    raise BadMedia(
                        f"{path}.input_audio.format",
                        f"format {audio.get('format')!r} is not supported; send 'wav'",
                    )
                raw = decode_b64(audio["data"], f"{path}.input_audio.data")
                part = {**part, "input_audio": decode_audio(raw, f"{path}.input_audio.data")}
            parts.append(part)
        out.append({**msg, "content": parts})
    return out
