"""Issue 72, part 1: an answer at a moment T never sees a frame after T, for every method. The demo
clip shows a circle first; a square first appears at 3.0 s, a triangle later still."""

import pytest

from mmkv_cli.core.options import AskOptions, GenerationOptions
from mmkv_cli.methods import METHODS
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES
from tests.helpers import encode_pack

LAST = "which shape appeared last ?"
# a budget each method takes: a share for those that keep one, tokens for streaming memories
TOKENS = {"hermes", "recency", "streammem", "infinipot", "h2o"}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_no_block_after_the_moment_enters_its_answer(tmp_path, backbones, method):
    from mmkv_cli import api

    pack = tmp_path / f"{method}.kvpack"
    extra = {"budget_tokens": 24} if method in TOKENS else {}
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", method, **extra)
    times = {}
    reader = PackReader(pack)
    for index in range(len(reader.blocks)):
        row = reader.blocks[index]
        times[reader.blocks.name(index)] = row["time"]
    reader.source.close()
    for at in (0.0, 2.0, 2.9):
        options = AskOptions(at=at, generation=GenerationOptions(max_new_tokens=2), explain=True)
        answer = api.PackSession(pack, shared=True).ask(LAST, options)
        shown = [times[name] for name in answer.blocks_used if times.get(name)]
        assert all(end <= at + 1e-9 for _, end in shown), (method, at, shown)
        # --explain lists every block of the context (retrieval's or not) with the span it shows
        listed = [entry["block"] for entry in answer.retrieved]
        assert sorted(listed) == sorted(answer.blocks_used), (method, at)
        spans = [entry["time"] for entry in answer.retrieved if entry["time"]]
        assert all(end <= at + 1e-9 for _, end in spans), (method, at, spans)
        assert answer.answer.split()[0] not in ("square", "triangle"), (method, at, answer.answer)
