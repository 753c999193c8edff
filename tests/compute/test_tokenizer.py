"""Tokenizer, chat template and streaming detokenization against transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniflow.compute import RequestError
from omniflow.compute._tokenizer import Detokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(model_dirs: Callable[[str], Path]) -> Tokenizer:
    return Tokenizer.from_dir(model_dirs("llama"))


def test_chat_template_renders_like_transformers(
    tok: Tokenizer, model_dirs: Callable[[str], Path]
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dirs("llama"))
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2048?"},
        {"role": "assistant", "content": "A number."},
        {"role": "user", "content": "Thanks!"},
    ]
    for gen in (True, False):
        want = hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert tok.render_chat(msgs, add_generation_prompt=gen) == want
    assert tok.encode("Hello there") == hf("Hello there").input_ids


def test_no_template_is_a_request_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.backend, {}, None)
    with pytest.raises(RequestError, match="chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_detokenizer_stream_adds_up_to_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    d = Detokenizer(tok)
    streamed = "".join(d.push(i) for i in ids) + d.flush()
    assert streamed == tok.decode(ids)
