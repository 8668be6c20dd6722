"""`import mmkv`: keyword arguments in, the same answers as the CLI's verbs out."""

import pytest

import mmkv
from mmkv_cli import api
from mmkv_cli.core.options import AskOptions, LoadOptions
from tests.conftest import SAMPLES


def test_encode_ask_open_and_stream_answer_as_the_api_does(tmp_path, clip):
    out = tmp_path / "c.kvpack"
    summary = mmkv.encode(clip, out, model="demo", method="recency", budget=0.5, max_frames=8)
    assert summary.method == "recency" and mmkv.inspect(out).budget == 0.5
    question = "which shape appeared first ?"
    expected = api.ask(out, question, AskOptions(), load=LoadOptions("demo")).answer
    assert mmkv.ask(out, question).answer == expected
    with mmkv.open(out) as pack:
        assert "".join(pack.stream(question)) == expected
        pieces = pack.stream("what color is the circle ?", max_new_tokens=16)
        next(pieces)
        pieces.close()  # stopping early stops the decoding; the pack answers on
        assert pack.ask(question, at=1.0).answer
    with pytest.raises(mmkv.UsageError, match="temperature"):
        mmkv.ask(out, question, temperature=float("nan"))
    assert mmkv.verify(out).ok
    with pytest.raises(mmkv.OutputExistsError, match=r"pass force=True") as kept:
        mmkv.encode(clip, out, model="demo", method="recency", budget=0.5, max_frames=8)
    assert "--force" not in str(kept.value)  # Python's words, not the CLI's
    assert mmkv.encode(clip, out, model="demo", method="full", max_frames=8, force=True)


def test_inspect_says_the_bits_a_stored_value_takes(tmp_path):
    """kv_bits is what a stored value takes: 32 for a float32 pack (not the 16 of "as computed"),
    the quantized width for a quantized one."""
    clip = str(SAMPLES / "clip.mp4")
    plain = mmkv.encode(clip, tmp_path / "f.kvpack", model="demo", max_frames=4)
    assert plain.details["kv_dtype"] == "float32" and plain.kv_bits == 32
    packed = mmkv.encode(clip, tmp_path / "q.kvpack", model="demo", max_frames=4, kv_bits=4)
    assert mmkv.inspect(tmp_path / "q.kvpack").kv_bits == 4 == packed.kv_bits
