"""Text in images on rapidocr-onnxruntime (PP-OCRv4 detection + recognition, ONNX, in its wheel).

import omniflow as of
ocr = of.roles.Ocr()                    # a role: image -> text
await ocr.setup(); await ocr.read_image(of.Image.from_bytes(png))   # 'STOP HERE'

Not batched across calls (``of.Batch``): rapidocr reads one picture at that picture's own size
and already batches its text lines; four pictures through its detector together cost as much
per picture as alone (docs/concurrency.md, "Which roles of the repo are batched").
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from omniflow._exceptions import MediaError
from omniflow._media import Image
from omniflow.dsl import Role, interface

__all__ = ["Ocr"]


class Ocr(Role):
    """``read``: ``image`` (an ``of.Image``; None: nothing) -> ``text`` (lines top to bottom)."""

    def __init__(self, min_score: float = 0.5) -> None:
        #: Recognised lines below this confidence are dropped.
        self.min_score = min_score
        self._engine: Any = None
        #: One onnxruntime session pair, used by one image at a time.
        self._lock = threading.Lock()

    async def setup(self) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR  # type: ignore[import-untyped]
        except ImportError as exc:
            raise RuntimeError(
                "ocr: rapidocr-onnxruntime is missing: pip install 'omniflow[vision]'"
            ) from exc
        self._engine = await asyncio.to_thread(RapidOCR)

    def _run(self, image: Image) -> str:
        with self._lock:
            # rapidocr takes OpenCV's BGR order
            result, _elapse = self._engine(image.pixels[:, :, ::-1].copy())
        lines = [(box, text) for box, text, score in result or () if score >= self.min_score]
        lines.sort(key=lambda bt: (min(p[1] for p in bt[0]), min(p[0] for p in bt[0])))
        return "\n".join(text for _box, text in lines)

    async def read_image(self, image: Image) -> str:
        """The text rapidocr reads in ``image``, one line per detected box."""
        if not isinstance(image, Image):
            raise MediaError(
                f"ocr: 'image' must be an of.Image, got {type(image).__name__}", field="image"
            )
        if self._engine is None:
            await self.setup()
        return await asyncio.to_thread(self._run, image)

    @interface(inputs_or=[["image"]], outputs=["text"])
    async def read(self, image: Image | None) -> dict[str, Any] | None:
        if image is None:
            return None
        return {"text": await self.read_image(image)}
