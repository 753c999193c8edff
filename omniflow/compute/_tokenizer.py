"""Tokenizer, chat template and streaming detokenization for a Hugging Face model directory.

>>> # tok = Tokenizer.from_dir("path/to/model")
>>> # ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])

``tokenizer.json`` is read by the ``tokenizers`` library; the chat template comes from
``chat_template.jinja`` or ``tokenizer_config.json`` and is rendered in a Jinja sandbox the way
``transformers`` renders it (``messages``, ``add_generation_prompt``, special tokens as variables).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from omniflow.compute._errors import ModelLoadError, RequestError

__all__ = ["Detokenizer", "Tokenizer"]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


class Tokenizer:
    """Encode, decode and apply the chat template of one model."""

    def __init__(self, backend: Any, config: dict[str, Any], template: str | None) -> None:
        self.backend = backend  #: a ``tokenizers.Tokenizer``
        self.config = config  #: tokenizer_config.json
        self.chat_template = template  #: Jinja source, None when the model has none
        self.bos_token = _token_text(config.get("bos_token"))  #: text of BOS, if any
        self.eos_token = _token_text(config.get("eos_token"))  #: text of EOS, if any
        eos = self.backend.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos  #: id of EOS, if any
        self._compiled: Any = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(
                f"model directory {str(root)!r} has no tokenizer.json; pass input_ids instead of "
                "a prompt, or save the tokenizer with save_pretrained",
                path=str(path),
            )
        backend = Backend.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template: Any = config.get("chat_template")
        jinja_path = root / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(backend, config, template if isinstance(template, str) else None)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The chat template applied to ``messages`` as text."""
        if self.chat_template is None:
            raise RequestError(
                "this model has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); send a plain prompt instead of messages",
                field="messages",
            )
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        specials = {
            k: _token_text(v)
            for k, v in self.config.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        rendered: str = self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **specials
        )
        return rendered

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered template (special tokens come from the template itself)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Detokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    Decodes a short window around the new tokens and emits only text that is final: a delta
    ending in an incomplete UTF-8 sequence (U+FFFD) waits for the next token.
    """

    __slots__ = ("_ids", "_prefix", "_read", "_tok")

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self._ids: list[int] = []
        self._prefix = 0  #: start of the decoding window
        self._read = 0  #: ids before this have been emitted as text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of generation)."""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        after = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
