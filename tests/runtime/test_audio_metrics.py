"""Time to first audio and the real-time factor of ``of.Audio`` outputs (``/metrics``)."""

from __future__ import annotations

from typing import Any

import numpy as np

import omniflow as of
from omniflow.serve._metrics import HttpMetrics, render


class Speaker(of.Role):
    @of.interface(inputs_or=[["text"]], outputs=["speech", "words"])
    async def speak(self, text: str) -> Any:
        for word in text.split():
            yield {"words": word}
            # half a second of silence per word, at 16 kHz
            yield {"speech": of.Audio(np.zeros(8000, dtype=np.int16), sample_rate=16000)}


graph = of.Graph(
    "speaker", roles={"s": Speaker()}, inputs=[of.Placeholder("text")],
    outputs=["speech", "words"],
)  # fmt: skip


async def test_audio_outputs_report_time_to_first_audio_and_real_time_factor() -> None:
    async with of.Runtime(graph, metrics=True) as rt:
        out = await rt.run("speaker", {"text": "one two three"})
        assert len(out["speech"]) == 3
        await rt.run("speaker", {"text": "four"})
        m = rt.metrics
        assert m is not None
        assert sum(m.first_audio[("speaker", "speech")].counts) == 2  # one per call
        rtf = m.audio_rtf[("speaker", "speech")]
        assert sum(rtf.counts) == 2 and rtf.total > 0
        assert ("speaker", "words") not in m.first_audio  # text is not audio
        text = render(rt, HttpMetrics(), inflight=0, draining=False)
    assert 'omniflow_first_audio_seconds_count{field="speech",graph="speaker"} 2.0' in text
    assert 'omniflow_audio_real_time_factor_count{field="speech",graph="speaker"} 2.0' in text
