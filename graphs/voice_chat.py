"""Voice chat: speech in, an LLM's answer out as text and speech, sentence by sentence.

    hear.hear        messages -> segment: the conversation as text; every ``input_audio`` part
                     (an ``of.Audio``, as the chat endpoint delivers it) transcribed by
                     pocketsphinx (``of.roles.Asr``: pretrained, en-US)
    llm.generate     segment -> text (deltas) + sentence + usage: graphs/omni_chat.py's
                     TorchEngine LLM (the tiny random-init model unless ``$OMNIFLOW_MODEL``)
                     with ``of.roles.Sentences`` splitting its stream into sentences
    tts.speak        sentence -> speech: espeak-ng (``of.roles.Tts``), one ``of.Audio`` per
                     sentence, as soon as the sentence is complete (with "audio" in modalities)

The same graph serves the speech and transcription endpoints (contract §9): ``input`` ->
``tts.say`` -> speech, and ``audio`` -> ``hear.transcribe`` -> text. Each request fills its own
Placeholders and leaves the others None; a node given None produces nothing, so the other
branches never run.

    omniflow serve graphs/voice_chat.py        # chat, realtime, audio/speech, transcriptions
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import omniflow as of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from omni_chat import SAMPLING_DEFAULTS, Llm  # graphs/ is not a package


def _text_of(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
        return str(part.get("text", ""))
    return None


class Hear(of.roles.Asr):
    """pocketsphinx for the chat (messages) and the transcription (audio) requests."""

    @of.interface(inputs_or=[["messages"]], outputs=["segment"])
    async def hear(self, messages: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        if messages is None:
            return None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m for m in messages
        ):
            raise of.InputError("messages must be a list of {'role', 'content'}", field="messages")
        convo = []
        for m in messages:
            content = m.get("content")
            parts = content if isinstance(content, list) else [content]
            words = []
            for part in parts:
                text = _text_of(part)
                if text is not None:
                    words.append(text)
                elif isinstance(part, dict) and isinstance(part.get("input_audio"), of.Audio):
                    words.append(await self.transcribe_audio(part["input_audio"]))
            convo.append({"role": str(m["role"]), "content": " ".join(w for w in words if w)})
        return {"segment": {"index": 0, "parts": [{"chat": convo}], "last": True}}


#: chat and realtime; audio/speech; audio/transcriptions (contract §9's endpoint table).
INPUTS = ("messages", "modalities", "voice", "audio_format", "input", "speed", "instructions",
          "audio", "language", "prompt")  # fmt: skip

graph = of.Graph(
    "voice_chat",
    roles={"hear": Hear(), "llm": Llm(), "tts": of.roles.Tts()},
    inputs=[of.Placeholder(name) for name in (*INPUTS, *SAMPLING_DEFAULTS)],
    outputs=["text", "speech", "usage"],
)
