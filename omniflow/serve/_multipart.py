"""``multipart/form-data`` bodies (RFC 7578), parsed from bytes already read.

>>> body = (b'--b\\r\\nContent-Disposition: form-data; name="model"\\r\\n\\r\\nasr\\r\\n'
...         b'--b\\r\\nContent-Disposition: form-data; name="file"; filename="a.wav"\\r\\n'
...         b'Content-Type: audio/wav\\r\\n\\r\\nRIFF...\\r\\n--b--\\r\\n')
>>> form = parse_form("multipart/form-data; boundary=b", body)
>>> form["model"].text(), form["file"].filename, form["file"].data
('asr', 'a.wav', b'RIFF...')

Why not Starlette's ``request.form()``: it needs the python-multipart package, and the server
reads a body whole anyway (``_guard`` bounds it by ``--max-body-mb``), so splitting it on its
boundary is all there is to do. Pure code, no I/O; a malformed body is a ``FormError`` the
route answers as a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message

__all__ = ["FormError", "Part", "parse_form"]


class FormError(ValueError):
    """The body is not the ``multipart/form-data`` its Content-Type says."""


@dataclass(frozen=True, slots=True)
class Part:
    """One field of the form."""

    #: The field's name.
    name: str
    #: Its bytes, as sent.
    data: bytes
    #: The file name, for a file field.
    filename: str | None = None
    #: Its Content-Type, if the part has one.
    content_type: str | None = None

    def text(self) -> str:
        try:
            return self.data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormError(f"form field '{self.name}' is not UTF-8 text") from exc


def _params(value: str) -> tuple[str, dict[str, str]]:
    """A header value's main value and its parameters (``form-data; name="x"``)."""
    msg = Message()
    msg["content-type"] = value
    params = msg.get_params() or []
    main = params[0][0].lower() if params else ""
    return main, {k.lower(): str(v) for k, v in params[1:]}


def parse_form(content_type: str, body: bytes) -> dict[str, Part]:
    """The fields of a ``multipart/form-data`` body (a repeated name: the last one wins)."""
    kind, params = _params(content_type)
    if kind != "multipart/form-data":
        raise FormError(f"expected a multipart/form-data body, got Content-Type {kind!r}")
    boundary = params.get("boundary")
    if not boundary:
        raise FormError("the multipart/form-data Content-Type has no boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    chunks = body.split(b"\r\n" + delimiter)
    first = chunks[0]
    if not first.startswith(delimiter):
        raise FormError("the body does not start with its multipart boundary")
    chunks[0] = first[len(delimiter) :]
    fields: dict[str, Part] = {}
    closed = False
    for chunk in chunks:
        if chunk.startswith(b"--"):
            closed = True
            break
        if not chunk.startswith(b"\r\n"):
            raise FormError("a multipart boundary is not followed by a line break")
        head, sep, data = chunk[2:].partition(b"\r\n\r\n")
        if not sep:
            raise FormError("a form part has no blank line after its headers")
        headers: dict[str, str] = {}
        for line in head.split(b"\r\n"):
            name, colon, value = line.decode("latin-1").partition(":")
            if not colon:
                raise FormError(f"malformed form part header {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()
        disposition, dparams = _params(headers.get("content-disposition", ""))
        if disposition != "form-data" or "name" not in dparams:
            raise FormError("a form part has no 'Content-Disposition: form-data; name=...'")
        name = dparams["name"]
        fields[name] = Part(name, data, dparams.get("filename"), headers.get("content-type"))
    if not closed:
        raise FormError("the multipart body is truncated (no closing boundary)")
    return fields
