"""Roles on real, pretrained models (extras ``omniflow[audio]``, ``omniflow[vision]``).

>>> import omniflow as of
>>> sorted(n for n in dir(of.roles) if n[0].isupper())
['Asr', 'Ocr', 'Sentences', 'Tts']

    Asr        of.Audio -> text       pocketsphinx's en-US model (in its wheel); 16 kHz mono
    Ocr        of.Image -> text       rapidocr-onnxruntime's PP-OCRv4 models (in its wheel)
    Tts        text -> of.Audio       Debian's espeak-ng (``espeak-ng --stdout``), per sentence
    Sentences  text deltas -> whole sentences (the splitter between an LLM and a TTS)

Each model loads in the role's ``setup()`` (so a worker process loads it, not the front) and its
CPU work runs in a thread (``asyncio.to_thread``), off the event loop. A missing package is an
error at setup naming the extra to install.
"""

from omniflow.roles._asr import Asr
from omniflow.roles._ocr import Ocr
from omniflow.roles._sentences import Sentences
from omniflow.roles._tts import Tts

__all__ = ["Asr", "Ocr", "Sentences", "Tts"]
