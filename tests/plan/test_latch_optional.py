"""``optional=`` and ``latch=`` at parse time: what they change in the plan, and the
GraphErrors that name node and field when they are misused."""

from __future__ import annotations

from typing import Any

import pytest

import omniflow as of


class _Llm(of.Role):
    @of.interface(inputs_or=[["prompt"]], outputs=["token"])
    async def gen(self, prompt: str) -> Any:
        yield {"token": prompt}


def _tts(**kw: Any) -> of.Role:
    class Tts(of.Role):
        @of.interface(inputs_or=[["token", "voice"]], outputs=["audio"], **kw)
        async def speak(self, token: Any, voice: Any) -> Any:
            return {"audio": (token, voice)}

    return Tts()


def _graph(tts: of.Role) -> of.Graph:
    return of.Graph(
        "tts",
        roles={"llm": _Llm(), "tts": tts},
        inputs=[of.Placeholder("prompt"), of.Placeholder("voice")],
        outputs=["audio"],
    )


def test_a_latched_field_never_makes_a_bucket() -> None:
    plain = of.parse(_graph(_tts()))
    assert ("tts.speak", 0) in plain.buckets
    latched = of.parse(_graph(_tts(latch=("voice",))))
    assert latched.buckets == frozenset()
    assert ("tts.speak", 0, "voice") not in latched.critical_slots
    assert latched.specs["tts.speak"].latch == frozenset({"voice"})
    # The dependency is still an edge of the plan.
    assert ("<input>", "voice", "tts.speak", 0) in latched.edges


def test_optional_is_recorded_and_keeps_the_bucket() -> None:
    plan = of.parse(_graph(_tts(optional=("voice",))))
    assert plan.specs["tts.speak"].optional == frozenset({"voice"})
    assert ("tts.speak", 0) in plan.buckets


@pytest.mark.parametrize(
    ("kw", "field", "words"),
    [
        ({"latch": ("speed",)}, "speed", "latch names 'speed'"),
        ({"optional": ("speed",)}, "speed", "optional names 'speed'"),
        ({"latch": ("token", "voice")}, "token", "every field of OR group 0 is latched"),
        ({"latch": ("voice",), "collect": ("voice",)}, "voice", "also in collect"),
    ],
)
def test_misused_latch_or_optional_is_a_graph_error(kw: Any, field: str, words: str) -> None:
    with pytest.raises(of.GraphError) as ei:
        of.parse(_graph(_tts(**kw)))
    assert ei.value.node == "tts.speak"
    assert ei.value.field == field
    assert words in str(ei.value)


def test_latch_and_optional_must_be_lists_of_names() -> None:
    with pytest.raises(of.GraphError, match="latch"):
        _tts(latch="voice")
    with pytest.raises(of.GraphError, match="optional"):
        _tts(optional=[""])
