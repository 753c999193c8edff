"""Sampling filters, seeds, and the stop-string watch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omniflow.compute import RequestError, SamplingParams
from omniflow.compute._sampling import StopWatch, make_generator, sample


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_top_k_never_draws_outside_the_k_best() -> None:
    logits = torch.arange(50, dtype=torch.float32)[None]
    p = SamplingParams(temperature=5.0, top_k=3, seed=1)
    g = make_generator(p)
    draws = {sample(logits, [p], [g])[0] for _ in range(200)}
    assert draws <= {47, 48, 49} and len(draws) > 1


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    p = SamplingParams(temperature=1.0, top_p=0.75, seed=2)
    g = make_generator(p)
    draws = {sample(logits, [p], [g])[0] for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.75 needs the second; 0.8 >= 0.75 stops there


def test_same_seed_same_draws() -> None:
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(20)]
    b = [sample(logits, [p], [g])[0] for g in [make_generator(p)] for _ in range(20)]
    assert a == b


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "sampling.max_new_tokens"),
        ({"temperature": -1}, "sampling.temperature"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"stop": ("",)}, "sampling.stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_a_single_stop_string_is_a_tuple() -> None:
    assert SamplingParams(stop="END").stop_strings == ("END",)


@given(
    st.text(alphabet="abcE ND", max_size=40),
    st.lists(st.sampled_from(["END", "ab", "c c", "DD"]), min_size=1, max_size=2),
    st.lists(st.integers(1, 5), max_size=20),
)
def test_stop_watch_emits_exactly_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    watch = StopWatch(tuple(stops))
    pieces, pos = [], 0
    for c in cuts:
        pieces.append(text[pos : pos + c])
        pos += c
    pieces.append(text[pos:])
    out, hit = "", False
    for piece in pieces:
        emitted, hit = watch.feed(piece)
        out += emitted
        if hit:
            break
    if not hit:
        out += watch.flush()
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    if first >= 0:
        assert hit and out == text[:first]
    else:
        assert not hit and out == text
