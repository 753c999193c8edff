"""serve/_media_json.py: media values as tagged JSON objects on the NDJSON call endpoint."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import omniflow as of
from omniflow.serve import _media_json as mj


def test_audio_and_image_round_trip_through_json() -> None:
    clip = of.Audio(np.arange(-50, 50, dtype=np.int16) * 300, sample_rate=16000)
    pic = of.Image(np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3))
    text = json.dumps({"clip": mj.encode(clip), "deep": [{"pic": mj.encode(pic)}], "n": 3})
    back = mj.decode_tree(json.loads(text))
    assert back["clip"] == clip and back["deep"][0]["pic"] == pic and back["n"] == 3
    assert mj.encode(3) is None and mj.encode(np.zeros(3)) is None


def test_float_audio_comes_back_as_16_bit() -> None:
    clip = of.Audio(np.array([0.0, 0.5, -0.5], dtype=np.float32), sample_rate=8000)
    back = mj.decode(mj.encode(clip) or {})
    assert isinstance(back, of.Audio) and back.samples.tolist() == [0, 16384, -16384]


def test_other_input_forms() -> None:
    raw = np.array([1, -2, 3], dtype="<i2").tobytes()
    got = mj.decode({"$audio": {"pcm16_b64": base64.b64encode(raw).decode(), "sample_rate": 8000}})
    assert got == of.Audio(np.array([1, -2, 3], dtype=np.int16), sample_rate=8000)
    got = mj.decode({"$audio": {"pcm16_b64": base64.b64encode(raw).decode()}})
    assert isinstance(got, of.Audio) and got.sample_rate == 24000
    import io

    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.new("RGB", (3, 2), (200, 10, 10)).save(out, format="JPEG")
    pic = mj.decode({"$image": {"jpeg_b64": base64.b64encode(out.getvalue()).decode()}})
    assert isinstance(pic, of.Image) and (pic.width, pic.height) == (3, 2)


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ({"$audio": "x"}, r"inputs\.a\.\$audio: expected an object with one of wav_b64"),
        ({"$audio": {"wav_b64": "!!"}}, r"inputs\.a\.\$audio\.wav_b64: not valid base64"),
        ({"$audio": {"wav_b64": 5}}, r"wav_b64: expected a base64 string, got int"),
        ({"$audio": {"wav_b64": "AAAA"}}, r"inputs\.a\.\$audio\.wav_b64: .*not a readable"),
        ({"$audio": {"wav_b64": "", "extra": 1}}, r"expected an object with one of"),
        ({"$audio": {"pcm16_b64": "AAAA"}}, r"pcm16_b64: an odd number of bytes"),
        ({"$audio": {"pcm16_b64": "", "sample_rate": 0}}, r"sample_rate: expected a positive"),
        ({"$image": {"png_b64": "AAAA"}}, r"inputs\.a\.\$image\.png_b64: .*PNG or JPEG"),
        ({"$image": {"gif_b64": "AAAA"}}, r"one of png_b64, jpeg_b64"),
    ],
)
def test_malformed_media_name_their_path(obj: dict[str, object], match: str) -> None:
    with pytest.raises(of.MediaError, match=match) as info:
        mj.decode_tree({"a": obj})
    assert info.value.field == "inputs.a"
    assert isinstance(info.value, of.InputError)  # the server answers 400


def test_plain_dicts_with_other_keys_pass_through() -> None:
    value = {"$audio": 1, "other": 2}
    assert mj.decode_tree(value) == value  # two keys: not a tagged object
    with pytest.raises(of.MediaError, match="one-key object"):
        mj.decode({"x": 1})
