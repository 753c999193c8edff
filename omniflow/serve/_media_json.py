"""Media values in the NDJSON call endpoint's JSON: ``{"$audio": ...}`` and ``{"$image": ...}``.

>>> import numpy as np, omniflow as of
>>> tagged = encode(of.Audio(np.zeros(4, np.int16), sample_rate=8000))
>>> sorted(tagged["$audio"])
['wav_b64']
>>> decode(tagged) == of.Audio(np.zeros(4, np.int16), sample_rate=8000)
True

``POST /v1/graphs/{name}/call`` carries media both ways as one-key tagged objects, beside
``$bytes`` and ``$tensor`` (serve/_codec.py):

    =============  ==========================================================================
    value          JSON
    =============  ==========================================================================
    ``of.Audio``   ``{"$audio": {"wav_b64": "<base64 of a 16-bit PCM mono WAV file>"}}``
    ``of.Image``   ``{"$image": {"png_b64": "<base64 of a PNG file>"}}``
    =============  ==========================================================================

On input ``$audio`` also takes ``{"pcm16_b64": ..., "sample_rate": 24000}`` (raw little-endian
16-bit mono samples) and ``$image`` ``{"jpeg_b64": ...}``. A decoded WAV of other widths or
channels becomes mono (``of.Audio.from_bytes``); float samples are written as 16-bit PCM, so
an ``of.Audio`` of float32 samples comes back as int16 ones (the WAV file is the wire form).
A malformed value raises ``MediaError`` (an ``InputError``: the server answers 400) naming the
input path, e.g. ``inputs.clip.$audio.wav_b64``.

Pure: no I/O, nothing of the server. The endpoint calls ``encode`` from its JSON ``default``
hook and ``decode_tree`` on a request's decoded inputs.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from omniflow._exceptions import MediaError
from omniflow._media import Audio, Image

__all__ = ["TAGS", "decode", "decode_tree", "encode", "is_tagged"]

#: The one-key objects this module reads and writes.
TAGS = ("$audio", "$image")

#: Accepted payload keys of each tag (the first is what ``encode`` writes).
_FORMS = {"$audio": ("wav_b64", "pcm16_b64"), "$image": ("png_b64", "jpeg_b64")}


def encode(value: Any) -> dict[str, Any] | None:
    """The tagged JSON object of a media value, or None when ``value`` is not one."""
    if type(value) is Audio:
        return {"$audio": {"wav_b64": _b64(value.to_wav())}}
    if type(value) is Image:
        return {"$image": {"png_b64": _b64(value.to_png())}}
    return None


def is_tagged(obj: Any) -> bool:
    """Whether ``obj`` is a one-key ``$audio`` / ``$image`` object (decode it, or fail)."""
    return type(obj) is dict and len(obj) == 1 and next(iter(obj)) in TAGS


def decode(obj: dict[str, Any], where: str = "value") -> Audio | Image:
    """The media value of a tagged object; ``where`` names it in errors."""
    if not is_tagged(obj):
        raise MediaError(
            f"{where}: expected a one-key object {{'$audio': ...}} or {{'$image': ...}}"
        )
    tag, spec = next(iter(obj.items()))
    forms = _FORMS[tag]
    keys = set(spec) if isinstance(spec, dict) else set()
    form = next((f for f in forms if f in keys), None)
    allowed = {form, "sample_rate"} if form == "pcm16_b64" else {form}
    if form is None or not keys <= allowed:
        raise MediaError(
            f"{where}.{tag}: expected an object with one of {', '.join(forms)}"
            + (" (and sample_rate)" if tag == "$audio" else "")
            + f", got {_describe(spec)}",
            field=where,
        )
    data = _unb64(spec[form], f"{where}.{tag}.{form}", where)
    try:
        if form == "pcm16_b64":
            return _pcm16(data, spec.get("sample_rate", 24000), where)
        if tag == "$audio":
            return Audio.from_bytes(data)
        return Image.from_bytes(data)
    except MediaError as exc:
        if exc.field == where:
            raise
        raise MediaError(f"{where}.{tag}.{form}: {exc}", field=where) from exc


def decode_tree(value: Any, where: str = "inputs") -> Any:
    """``value`` with every tagged object inside it (dicts and lists) decoded.

    >>> decode_tree({"n": 1, "xs": [{"$image": {"png_b64": "bad"}}]})
    Traceback (most recent call last):
    ...
    omniflow._exceptions.MediaError: inputs.xs[0].$image.png_b64: not valid base64 ...
    """
    if type(value) is dict:
        if is_tagged(value):
            return decode(value, where)
        return {k: decode_tree(v, f"{where}.{k}") for k, v in value.items()}
    if type(value) is list:
        return [decode_tree(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, path: str, field: str) -> bytes:
    if not isinstance(text, str):
        raise MediaError(f"{path}: expected a base64 string, got {_describe(text)}", field=field)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"{path}: not valid base64 ({exc})", field=field) from None


def _pcm16(data: bytes, rate: Any, where: str) -> Audio:
    import numpy as np

    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise MediaError(
            f"{where}.$audio.sample_rate: expected a positive int, got {rate!r}", field=where
        )
    if len(data) % 2:
        raise MediaError(
            f"{where}.$audio.pcm16_b64: an odd number of bytes ({len(data)})", field=where
        )
    return Audio(np.frombuffer(data, dtype="<i2").astype(np.int16), sample_rate=rate)


def _describe(obj: Any) -> str:
    if isinstance(obj, dict):
        return f"keys {sorted(map(str, obj))}"
    return type(obj).__name__
