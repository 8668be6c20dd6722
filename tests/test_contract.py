"""The contract every method keeps on every tiny family and every media kind: it encodes, its pack
inspects truthfully, and it answers a question asked at a moment, with stored and compacted
positions. One case per combination, so one failure hides no other (kvpress's default_presses table,
as a table)."""

import math

import pytest
import torch

from mmkv_cli import api
from mmkv_cli.backbones import tower_families
from mmkv_cli.core.errors import UsageError
from mmkv_cli.methods import METHODS
from mmkv_cli.methods.choice import resolve_method
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES, TINY
from tests.helpers import ask_pack, encode_pack
from tests.method_cases import CASES, case_for

MEDIA = {"video": "clip.mp4", "images": "images", "pdf": "doc.pdf"}


def serves(method: str, family: str, media: str) -> bool:
    """Whether the method's own token reducer takes this media kind on this family."""
    reduce = resolve_method(method).reduce
    if reduce is None:
        return True
    temporal_ok = not reduce.reducer.temporal or media == "video"
    return temporal_ok and (not reduce.reducer.tower_attention or family in tower_families())


@pytest.mark.parametrize("media", MEDIA)
@pytest.mark.parametrize("family", TINY)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_method_encodes_inspects_and_answers(tmp_path, backbones, method, family, media):
    backbone = backbones[family]
    case = case_for(method)
    pack = tmp_path / "p.kvpack"
    if not serves(method, backbone.family, media):  # its own reducer cannot: one line, no pack
        with pytest.raises(UsageError, match="reducer"):
            encode_pack(SAMPLES / MEDIA[media], pack, method=method, backbone=backbone)
        assert not pack.exists()
        return
    info = encode_pack(
        SAMPLES / MEDIA[media],
        pack,
        method=method,
        backbone=backbone,
        fps=2.0,
        max_frames=4,
        **case.budget,
    )
    thinned = {k: info[k] for k in ("frames_offered", "max_frames", "max_frames_by") if k in info}
    assert info == {
        **api.inspect(pack),
        "encode_s": info["encode_s"],
        "peak_kv_bytes": info["peak_kv_bytes"],
        **thinned,  # said only where the media offered more than max_frames
    }
    assert not thinned or thinned["frames_offered"] > info["media"]["frames"] == 4
    assert info["method"] == method and info["media"]["kind"] == media and info["blocks"] > 0
    total, kept = info["visual_tokens_total"], info["visual_tokens_kept"]
    layers = [layer["tokens_kept"] for layer in info["layers"]]
    assert kept == pytest.approx(sum(layers) / len(layers), abs=0.01)
    if METHODS[method].keeps_all:  # every token its reducer (if any) let through
        assert layers == [info["visual_tokens_prefilled"]] * len(layers)
        assert (info["visual_tokens_prefilled"] < total) == (METHODS[method].reducer is not None)
    elif METHODS[method].adaptive:  # its own thresholds: fewer than it prefilled, never none
        assert min(layers) > 0 and max(layers) <= info["visual_tokens_prefilled"]
    elif "budget_tokens" in case.budget:
        assert min(layers) > 0 and max(layers) <= case.budget["budget_tokens"]
    elif not case.views_overlap:  # the others keep about the budget, on average
        extra = PackReader(pack).header.layout.steps if case.per_step_extra else 0
        assert min(layers) > 0 and kept <= case.budget["budget"] * total + 1 + extra
    reader = PackReader(pack)
    times = reader.series("media.timestamps")
    at = times[len(times) // 2]
    ends = reader.blocks.times()[:, 1]  # a block's last frame: none after the moment is shown
    for positions in ("keep", "reindex"):
        answer = ask_pack(
            pack,
            "what color is the circle ?",
            backbone=backbone,
            max_new_tokens=2,
            keep_logits=True,
            at=at,
            positions=positions,
        )
        assert torch.isfinite(answer.first_logits).all()
        assert answer.context_tokens > info["prompt_tokens"] - 1
        used = [reader.blocks.index_of(name) for name in answer.blocks_used]
        assert all(math.isnan(ends[i]) or ends[i] <= at + 1e-9 for i in used)
        assert used or not (ends <= at).any()  # empty only when nothing kept was shown by then


@pytest.mark.parametrize("method", sorted(m for m in METHODS if METHODS[m].takes_budget))
def test_a_token_budget_works_for_every_compressing_method(tmp_path, backbones, method):
    info = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "p.kvpack",
        method=method,
        budget_tokens=16,
        backbone=backbones["tiny-llava-ov"],
    )
    assert info["budget_tokens"] == 16 and info["budget"] is None
    if case_for(method).views_overlap:  # every block keeps a token: 84 blocks, 16-token grid
        assert info["visual_tokens_kept"] < info["visual_tokens_total"] / 2
    else:  # per layer on average (pyramidkv, aircache and meda share it unevenly)
        extra = PackReader(tmp_path / "p.kvpack").header.layout.steps
        assert info["visual_tokens_kept"] <= 16 + (extra if case_for(method).per_step_extra else 0)


def test_every_row_of_the_case_table_names_a_method_in_the_registry():
    assert set(CASES) <= set(METHODS)
