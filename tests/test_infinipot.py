"""InfiniPot-V: temporal redundancy, value norms and the split between them on hand-made tensors;
the running cache held under its cap while a long stream goes through."""

import pytest
import torch

from mmkv_cli.api import PROCESS_BACKBONES
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.methods.infinipot import (
    choose,
    layer_pooling,
    pairs_by_cache_slot,
    pooled_norms,
    recent_entries,
    recent_mask,
    spatial_slots,
    tar_scores,
    value_norms,
)
from tests.helpers import choose as choose_method


def test_slots_count_from_the_end_of_each_step():
    # the second step has one more leading token (a Qwen3-VL time stamp): its grid still lines up
    steps = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    assert spatial_slots(steps).tolist() == [2, 1, 0, 3, 2, 1, 0]
    assert recent_mask(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 0.25).tolist() == [0] * 6 + [1] * 2
    assert recent_mask(torch.tensor([0, 1]), 0.0).tolist() == [False, False]


def _grid(frames: int, tokens: int, dim: int = 8) -> torch.Tensor:
    """Keys [1 head, frames * tokens, dim]: token t of every frame is the unit vector e_t."""
    eye = torch.eye(dim)[:tokens]
    return eye.repeat(frames, 1).unsqueeze(0)


def test_a_token_that_repeats_the_recent_frames_is_redundant_one_that_changed_is_not():
    keys = _grid(3, 4)
    keys[0, 1] = torch.tensor([0, 0, 0, 0, 0, 0, 1.0, 0])  # frame 0, place 1: looked different
    steps = torch.arange(3).repeat_interleave(4)
    reference = recent_mask(steps, 0.34)  # the newest frame
    score = tar_scores(keys, steps, spatial_slots(steps), reference)
    assert score[1] == pytest.approx(0.0) and score[0] == pytest.approx(-1.0)
    assert int(score[:8].argmax()) == 1
    # against the previous frame: frame 1 place 1 now differs from frame 0 place 1 too
    previous = tar_scores(keys, steps, spatial_slots(steps), "previous")
    assert previous[:4].tolist() == [0.0] * 4  # nothing before the first frame
    assert previous[5] == pytest.approx(0.0) and previous[4] == pytest.approx(-1.0)


def test_the_reference_counts_frames_worth_of_held_entries_as_the_authors_code_does():
    # process_kv_cache: int(query_ratio x held tokens / tokens a frame) frames, the newest entries.
    # A cache cut to 32 frames that took in 24 more holds 56: the reference is 14 frames, not 8
    assert int(recent_entries(56 * 196, 196, 0.25).sum()) == 14 * 196
    assert int(recent_entries(32 * 196, 196, 0.25).sum()) == 8 * 196
    # after an uneven eviction the count floors (9.5 frames held -> 2 frames of reference)
    mask = recent_entries(38, 4, 0.25)
    assert mask.tolist() == [False] * 30 + [True] * 8
    assert not recent_entries(3, 4, 0.25).any()  # less than a frame's worth: none


def test_after_an_eviction_the_code_pairs_by_cache_index_and_spatial_by_grid_place():
    # frames of 4 places; the older frame lost its place 1: its places 0, 2, 3 sit at cache 0..2,
    # the newer frame (the reference) at cache 3..6. Every key is its place's unit vector
    places = torch.tensor([0, 2, 3, 0, 1, 2, 3])
    keys = torch.eye(8)[places].unsqueeze(0)
    steps = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    reference = recent_entries(7, 4, 0.6)  # int(0.6 x 7 / 4) = 1 frame: cache 3..6
    assert reference.tolist() == [False] * 3 + [True] * 4
    # spatial: every older token meets its own place in the reference: all redundant
    spatial = tar_scores(keys, steps, places, reference)
    assert spatial[:3].tolist() == pytest.approx([-1.0, -1.0, -1.0])
    # the code: runs of 4 counted back from the newest entry; cache 0..2 are slots 1..3 of a
    # partial run, so place 0 (cache 0) meets place 1 of the reference and looks novel
    frames, slots = pairs_by_cache_slot(7, 4)
    assert frames.tolist() == [-1, -1, -1, 0, 0, 0, 0] and slots.tolist() == [1, 2, 3, 0, 1, 2, 3]
    by_slot = tar_scores(keys, frames, slots, reference)
    assert by_slot[:3].tolist() == pytest.approx([0.0, -1.0, -1.0])


def _pairwise_tar(keys, frames, slots, reference):
    """TaR as defined, a pair at a time: each token against every reference frame's token at its
    place, cosines averaged over heads, then over the pairs it has (0 with none)."""
    unit = torch.nn.functional.normalize(keys.double(), dim=-1)
    out = torch.zeros(keys.shape[1], dtype=torch.float64)
    for i in range(keys.shape[1]):
        partners = (reference & (slots == slots[i])).nonzero().squeeze(1)
        if partners.numel():
            out[i] = -(unit[:, i : i + 1] * unit[:, partners]).sum(-1).mean(0).mean()
    return out


@pytest.mark.parametrize(
    ("frames", "per_frame", "share"), [(7, 4, 0.6), (300, 4, 0.25), (9, 49, 0.25)]
)
def test_tar_against_every_reference_frame_is_the_pairwise_definition(frames, per_frame, share):
    # many frames of few tokens (the demo backbone's 4 a frame under a 4K cap: a thousand frames
    # held, hundreds of them the reference) as well as real grids; a partial oldest run too
    torch.manual_seed(frames)
    n = frames * per_frame - 3
    keys = torch.randn(2, n, 16)
    reference = recent_entries(n, per_frame, share)
    cut, places = pairs_by_cache_slot(n, per_frame)
    got = tar_scores(keys, cut, places, reference)
    torch.testing.assert_close(got, _pairwise_tar(keys, cut, places, reference).float())
    steps = torch.arange(n) // per_frame  # spatial places, a reference of whole steps
    spatial = spatial_slots(steps)
    reference = recent_mask(steps, share)
    got = tar_scores(keys, steps, spatial, reference)
    torch.testing.assert_close(got, _pairwise_tar(keys, steps, spatial, reference).float())


def test_value_norms_average_the_heads():
    values = torch.zeros(2, 3, 4)
    values[0, 1, 0], values[1, 1, 0] = 3.0, 1.0
    assert value_norms(values).tolist() == [0.0, 2.0, 0.0]


def test_adaptive_pooling_goes_by_depth_quarter_as_the_code_counts():
    # the code: idx = layer // (layers // 4) into [3, 2, 1, -1] dimensions, [7, 5, 3, 1] kernels
    assert [layer_pooling(i, 28) for i in (0, 6, 7, 13, 14, 20, 21, 27)] == [
        (3, 7), (3, 7), (2, 5), (2, 5), (1, 3), (1, 3), (0, 0), (0, 0)
    ]  # fmt: skip
    # 26 layers: the code's index would reach 4 at layer 24; here those layers are the last quarter
    assert [layer_pooling(i, 26)[0] for i in (23, 24, 25)] == [0, 0, 0]
    assert [layer_pooling(i, 2) for i in (0, 1)] == [(3, 7), (2, 5)]  # shallower than 4 layers


def _reference_pooled(values: torch.Tensor, dims: int, kernel: int, rows: int) -> torch.Tensor:
    """The code's pooling: per head, the held entries' value norms [H, n] (n whole frames)
    reshaped [H, frames, rows, -1] and AvgPool3d'ed (as one unbatched volume a head) or
    AvgPool2d'ed (each frame a channel), the window no larger than the frames, rows or columns
    (odd, none under 2), or AvgPool1d'ed as [H, n]; then, as mmkv keeps one set per layer,
    averaged over heads."""
    score = values.norm(dim=-1)  # [H, n]
    heads, n = score.shape
    if dims > 1:
        volume = score.reshape(heads, n // (rows * rows), rows, -1)
        size = min(kernel, *volume.shape[1:])
        size -= 1 if size % 2 == 0 else 0
        if size >= 2:
            pool = torch.nn.AvgPool3d if dims == 3 else torch.nn.AvgPool2d
            volume = pool(size, stride=1, padding=size // 2)(volume)
        score = volume.reshape(heads, -1)
    else:
        score = torch.nn.AvgPool1d(kernel, stride=1, padding=kernel // 2)(score)
    return score.mean(dim=0)


@pytest.mark.parametrize("frames", [9, 4, 3, 2])
@pytest.mark.parametrize(("dims", "kernel"), [(3, 7), (2, 5), (1, 3)])
def test_pooled_value_norms_are_the_codes(dims, kernel, frames):
    """Across frames in the first quarter; the window shrinks with few frames held, as the
    code's does (4 frames: 3; 2 frames: none)."""
    torch.manual_seed(0)
    values = torch.randn(2, frames * 64, 8)  # 2 heads, frames of an 8 x 8 grid
    got = pooled_norms(value_norms(values), dims, kernel, per_frame=64, grid=(8, 8))
    torch.testing.assert_close(got, _reference_pooled(values, dims, kernel, 8))
    if frames == 2 and dims > 1:
        torch.testing.assert_close(got, value_norms(values))
    assert torch.equal(pooled_norms(value_norms(values), 0, 0, 64, (8, 8)), value_norms(values))


def test_a_partial_oldest_frame_is_padded_in_front():
    """An eviction left 40 of the oldest frame's 64 entries: it pools as a frame padded with
    zeros in front; within each frame's grid the newer frames' pooled norms are unchanged."""
    torch.manual_seed(0)
    values = torch.randn(2, 3 * 64, 8)
    got = pooled_norms(value_norms(values), 2, 5, per_frame=64, grid=(8, 8))
    tail = pooled_norms(value_norms(values[:, 24:]), 2, 5, per_frame=64, grid=(8, 8))
    torch.testing.assert_close(tail[40:], got[64:])
    assert tail.shape == (168,)
    assert pooled_norms(value_norms(values[:, 24:]), 3, 7, 64, (8, 8)).shape == (168,)
    # stamped steps (not one whole grid) pool along the cache
    torch.testing.assert_close(
        pooled_norms(value_norms(values), 2, 3, per_frame=66, grid=(8, 8)),
        _reference_pooled(values, 1, 3, 8),
    )


def test_adaptive_pooling_changes_what_value_norm_keeps(tmp_path, backbones):
    from mmkv_cli.encode.encoder import encode_media
    from mmkv_cli.media import load_media
    from mmkv_cli.study.synth import write_dataset

    write_dataset(tmp_path / "set", clips=1, frames=24, seed=3, kind="normal")
    media = load_media(str(tmp_path / "set" / "clips" / "clip_0000.mp4"), max_frames=24)
    kept = {}
    for pooling in ("none", "layer_adaptive"):
        choice = choose_method("infinipot", budget_tokens=96, chunk_frames=2, pooling=pooling)
        out = encode_media(backbones["tiny-llava-ov"], media, choice)
        kept[pooling] = [
            sorted((b.steps[0], p) for b in out.blocks for p in b.positions[layer][-1].tolist())
            for layer in range(4)
        ]
        assert [sum(b.layer_counts[i] for b in out.blocks) for i in range(4)] == [96] * 4
    # the first layer's value norms are averaged over its 4 x 4 grids (7 x 7 windows): what it
    # keeps moves (the layers above see other context from then on, so theirs move too)
    assert kept["none"][0] != kept["layer_adaptive"][0]


def test_the_split_keeps_the_reference_then_tar_then_value_norm():
    tar = torch.tensor([0.0, -1.0, -0.1, -1.0, -1.0, -1.0, 0.0, 0.0])
    van = torch.tensor([0.0, 9.0, 0.0, 5.0, 1.0, 0.0, 0.0, 0.0])
    reference = torch.tensor([False] * 6 + [True] * 2)
    kept = choose(tar, van, reference, count=6, tar_share=0.5)
    # tar budget 3: the two reference tokens and token 0 (most novel); then 1, 3, 4 by value norm
    assert kept.tolist() == [0, 1, 3, 4, 6, 7]
    assert choose(tar, van, reference, count=2, tar_share=0.5).tolist() == [1, 7]
    assert choose(tar, van, reference, count=20, tar_share=0.5).numel() == 8


@pytest.mark.parametrize("selection", ["per_head", "per_layer"])
def test_a_long_stream_stays_under_the_cap_and_the_pack_holds_it(tmp_path, selection):
    """Every (layer, KV head) of the pack holds the cap. The running cache never passes it per
    layer; per head it holds the union of the heads' own sets, at most one cap a head."""
    from mmkv_cli.encode.encoder import encode_media
    from mmkv_cli.media import load_media
    from mmkv_cli.study.synth import write_dataset

    write_dataset(tmp_path / "set", clips=1, frames=64, seed=3, kind="normal")
    media = load_media(str(tmp_path / "set" / "clips" / "clip_0000.mp4"), max_frames=64)
    cap = 96  # 24 frames of 4 tokens; chunks of 4 frames (16 tokens)
    choice = choose_method("infinipot", budget_tokens=cap, chunk_frames=4, selection=selection)
    demo = PROCESS_BACKBONES.get(LoadOptions("demo", "cpu"))  # its trained heads disagree
    out = encode_media(demo, media, choice)
    frames, heads = media.num_frames, 2 if selection == "per_head" else 1
    assert frames >= 24 and out.visual_tokens_total == frames * 4
    stored = len(out.blocks[0].keys)  # (layer, KV head) pairs per head, else layers
    kept = [sum(b.layer_counts[i] for b in out.blocks) for i in range(stored)]
    assert kept == [cap] * stored and out.per_head == (selection == "per_head")
    per_token = 2 * 2 * 32 * 4 * 4  # K and V, 2 KV heads, head dim 32, float32, 4 layers
    prompt = out.prefix.layer_counts[0]
    assert out.stats["peak_kv_bytes"] <= (prompt + heads * cap) * per_token
    # the newest frames are TaR's reference and stay whole, in every head
    assert out.blocks[-1].layer_counts == [4] * stored and out.blocks[-1].steps == (
        frames - 1,
        frames,
    )
    assert len(out.blocks) > 6  # older frames survive in part, not only the newest six
    assert choose_method("infinipot", budget=0.1).budget.share == 0.1


def _held_per_head(keys: torch.Tensor, values: torch.Tensor, per_frame: int, **params):
    """One layer of two KV heads, a 2-token prompt, then keys / values [2, n, D] at positions
    2.., streamed whole; `finish` holds it to budget_tokens. Returns each head's stream indices."""
    from transformers import DynamicCache

    from mmkv_cli.methods import Budget, EncodeContext
    from mmkv_cli.methods.infinipot import InfiniPotMemory, InfiniPotParams
    from mmkv_cli.methods.running_cache import RunningCache, StreamState

    n = keys.shape[1]
    cache = DynamicCache()
    prompt = torch.zeros(1, 2, 2, keys.shape[-1])
    cache.update(
        torch.cat([prompt, keys[None].float()], 2), torch.cat([prompt, values[None].float()], 2), 0
    )
    running = RunningCache(cache, prompt_len=2, position_dims=1)
    running.appended(torch.arange(n), torch.arange(2, 2 + n).view(1, -1))
    state = StreamState(
        cache=running,
        token_step=torch.arange(n) // per_frame,
        layout_positions=torch.arange(2, 3 + n).view(1, -1),
        total=n,
        seen=n,
    )
    budget = Budget(tokens=params.pop("budget_tokens"))
    InfiniPotMemory(InfiniPotParams(**params), budget, EncodeContext("video")).finish(state)
    return [sorted(running.index[0][e].tolist()) for e in running.head_entries(0)]


def test_each_kv_head_keeps_its_own_by_its_own_tar_and_value_norms():
    """The authors' process_kv_cache, per KV head, written out: the newest frame's worth of
    entries is the reference (int(0.25 x 12 / 2) = 1 frame), TaR picks 6 - round(0.5 x 6) = 3
    (the reference's 2, then the token least like the reference token at its slot), value norm
    the other 3; each head by its own keys and values."""
    torch.manual_seed(5)
    keys, values = torch.randn(2, 12, 4, dtype=torch.float64), torch.randn(2, 12, 4).double()

    def by_definition(k: torch.Tensor, v: torch.Tensor) -> list[int]:
        n = len(k)
        unit = k / k.norm(dim=-1, keepdim=True)
        keep = {n - 2, n - 1}  # the reference frame: its tokens at slots 0 and 1
        tar = {i: -float(unit[i] @ unit[n - 2 + i % 2]) for i in range(n) if i not in keep}
        keep.add(max(tar, key=tar.get))
        norm = {i: float(v[i].norm()) for i in range(n) if i not in keep}
        keep |= set(sorted(norm, key=norm.get, reverse=True)[:3])
        return sorted(keep)

    held = _held_per_head(keys, values, per_frame=2, budget_tokens=6)
    assert held == [by_definition(keys[h], values[h]) for h in range(2)]
    assert held[0] != held[1]  # they differ: one set a layer could not be both
    mean = _held_per_head(keys, values, per_frame=2, budget_tokens=6, selection="per_layer")
    assert mean[0] == mean[1] and len(mean[0]) == 6  # per_layer: one set, the heads' mean scores
