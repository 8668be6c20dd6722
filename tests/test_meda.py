"""MEDA: entropy allocation, recent + heavy selection, and the merge pairing, on hand-made tensors;
then encode."""

import math

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods.meda import (
    entropy_ratios,
    head_entropy_total,
    merge_evicted,
    recent_and_heavy,
    row_entropy,
)
from tests.helpers import choose


def test_row_entropy_is_renormalised_over_the_chosen_columns():
    rows = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.1, 0.9, 0.0, 0.0]])
    h = row_entropy(rows, slice(1, 3))
    assert h[0] == pytest.approx(math.log(2), abs=1e-5)  # 0.25 / 0.25 -> uniform over two
    assert h[1] == pytest.approx(0.0, abs=1e-4)  # all of it on one column


def test_entropy_is_each_heads_own_then_averaged_as_the_authors_compute_it():
    # one row, two heads, each sure of a different key: every head's entropy is 0, so their mean is
    # 0; averaged over heads first the row is uniform over two keys, log 2
    block = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [B=1, H=2, r=1, k=2]
    assert head_entropy_total(block, "per_head").item() == pytest.approx(0.0, abs=1e-4)
    assert head_entropy_total(block, "head_mean").item() == pytest.approx(math.log(2), abs=1e-5)
    # two rows, heads of entropy log 2 and log 4 (renormalised over the columns given): the rows'
    # per-head means add up, (log 2 + log 4) / 2 each
    half = torch.tensor([0.5, 0.5, 0.0, 0.0]) * 0.5  # attention leaking elsewhere: renormalised
    quarter = torch.full((4,), 0.25)
    block = torch.stack([torch.stack([half, half]), torch.stack([quarter, quarter])])[None]
    expected = 2 * (math.log(2) + math.log(4)) / 2
    assert head_entropy_total(block, "per_head").item() == pytest.approx(expected, abs=1e-5)
    # per_head is never above head_mean (entropy is concave)
    rows = torch.rand(3, 4, 5, 9).softmax(dim=-1)
    assert (head_entropy_total(rows, "per_head") <= head_entropy_total(rows, "head_mean")).all()


def test_entropy_allocation_gives_more_to_the_higher_entropy_layer_and_sums_to_the_budget():
    ratios = entropy_ratios([1.0, 2.0, 1.5, 0.5], rho=0.2)
    assert ratios[1] == max(ratios) and ratios[3] == min(ratios)
    assert sum(ratios) == pytest.approx(4 * 0.2)
    clamped = entropy_ratios([0.0, 30.0], rho=0.6)
    assert clamped == [0.01, 1.0]


def test_recent_window_and_heavy_hitters_three_to_one():
    cumulative = torch.tensor([9.0, 0.1, 0.2, 8.0, 0.3, 0.1, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1])
    kept = recent_and_heavy(cumulative, keep=4, recent_share=0.75)
    assert kept.tolist() == [0, 9, 10, 11]  # three newest, then the heaviest of the rest


def test_each_evicted_key_merges_into_its_nearest_kept_key_in_the_same_head():
    # two heads, four tokens, keep tokens 0 and 1. Token 2 resembles token 1 in head 0 but token 0
    # in head 1; token 3 resembles token 0 in head 0 and token 1 in head 1.
    keys = torch.tensor(
        [
            [[1.0, 0.0], [0.0, 1.0], [0.1, 0.9], [0.9, -0.1]],
            [[1.0, 0.0], [0.0, 1.0], [0.8, 0.2], [0.2, 0.9]],
        ]
    )
    values = torch.arange(16, dtype=torch.float32).reshape(2, 4, 2)
    k, v, target = merge_evicted(keys, values, torch.tensor([0, 1]), form="mean")
    assert target.tolist() == [[1, 0], [0, 1]]
    assert torch.allclose(k[0, 1], (keys[0, 1] + keys[0, 2]) / 2)
    assert torch.allclose(k[0, 0], (keys[0, 0] + keys[0, 3]) / 2)
    assert torch.allclose(k[1, 0], (keys[1, 0] + keys[1, 2]) / 2)
    assert torch.allclose(v[1, 1], (values[1, 1] + values[1, 3]) / 2)
    assert torch.allclose(v[0, 1], (values[0, 1] + values[0, 2]) / 2)
    # A kept key nobody joins stays as it was.
    k2, v2, target2 = merge_evicted(keys, values, torch.tensor([0, 1, 2]), form="mean")
    assert target2.tolist() == [[0], [1]]
    assert torch.equal(k2[0, 1], keys[0, 1]) and torch.equal(k2[0, 2], keys[0, 2])
    assert torch.equal(k2[1, 0], keys[1, 0]) and torch.equal(v2[1, 2], values[1, 2])


def test_the_pivot_merge_is_meda_classes_pair_averages_around_the_kept_entry():
    """The authors' AttnEntropyTextPivotMerge_LayerWise: each joiner is first averaged with the
    kept pivot, then the pivot and those pair averages are averaged: written out for one pivot
    with two joiners and one with one, from that definition."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.8, 0.3], [0.1, 0.9]]])
    values = torch.tensor([[[2.0, 0.0], [0.0, 4.0], [6.0, 2.0], [4.0, 8.0], [2.0, 6.0]]])
    k, v, target = merge_evicted(keys, values, torch.tensor([0, 1]))  # pivot: the default
    assert target.tolist() == [[0, 0, 1]]  # tokens 2 and 3 join 0, token 4 joins 1
    for x, merged in ((keys[0], k[0]), (values[0], v[0])):
        pivot0 = (x[0] + (x[2] + x[0]) / 2 + (x[3] + x[0]) / 2) / 3
        pivot1 = (x[1] + (x[4] + x[1]) / 2) / 2
        assert torch.allclose(merged[0], pivot0) and torch.allclose(merged[1], pivot1)
    mean_k, _, _ = merge_evicted(keys, values, torch.tensor([0, 1]), form="mean")
    assert torch.allclose(mean_k[0, 0], (keys[0, 0] + keys[0, 2] + keys[0, 3]) / 3)


def test_merging_block_by_block_matches_merging_at_once():
    # The evicted-by-kept similarity is taken a block of rows at a time (whole, it would be 300 GB
    # for a 7B at 1800 frames); every block size gives the same joins and the same merged KV.
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 50, 8, generator=gen), torch.randn(2, 50, 8, generator=gen)
    kept = torch.tensor([0, 3, 7, 20, 41, 49])
    k, v, target = merge_evicted(keys, values, kept, block_rows=10_000)
    for rows in (1, 7, 44):
        k_b, v_b, target_b = merge_evicted(keys, values, kept, block_rows=rows)
        assert torch.equal(target_b, target)
        assert torch.allclose(k_b, k) and torch.allclose(v_b, v)
    assert target.shape == (2, 44) and len(set(target[0].tolist())) > 1


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_meda_encode_keeps_about_rho_and_merges(backbones, model):
    media = load_media("samples/clip.mp4", fps=8, max_frames=16)
    packs = {}
    for merge in (True, False):
        choice = choose("meda", budget=0.25, merge=merge, chunk_frames=8)
        packs[merge] = encode_media(backbones[model], media, choice)
    merged, dropped = packs[True], packs[False]
    total = merged.visual_tokens_total
    kept = [sum(b.layer_counts[layer] for b in merged.blocks) for layer in range(4)]
    assert sum(kept) == pytest.approx(0.25 * 4 * total, abs=4)
    for layer in range(4):  # same tokens chosen; merging changed what they hold
        pos_m = torch.cat([b.positions[layer] for b in merged.blocks], dim=1)
        pos_d = torch.cat([b.positions[layer] for b in dropped.blocks], dim=1)
        assert torch.equal(pos_m, pos_d)
    keys_m = torch.cat([b.keys[2] for b in merged.blocks], dim=1)
    keys_d = torch.cat([b.keys[2] for b in dropped.blocks], dim=1)
    assert not torch.allclose(keys_m, keys_d)


def test_evicted_visual_kv_may_merge_into_the_prompts_text_tokens(backbones):
    """Paper Eq. 11: targets are kept text and visual tokens. Merged text KV is the pack's prefix
    (and what the suffix was prefilled after); with visual-only targets the prompt is untouched."""
    media = load_media("samples/clip.mp4", fps=8, max_frames=16)
    backbone = backbones["tiny-llava-ov"]
    out = {
        into: encode_media(backbone, media, choose("meda", budget=0.25, merge_into=into))
        for into in ("text_and_visual", "visual")
    }
    plain = encode_media(backbone, media, choose("meda", budget=0.25, merge=False))
    for layer in range(4):
        assert torch.equal(out["visual"].prefix.keys[layer], plain.prefix.keys[layer])
    changed = [
        not torch.equal(out["text_and_visual"].prefix.values[layer], plain.prefix.values[layer])
        for layer in range(4)
    ]
    assert any(changed)
    # a merged text slot is the mean of itself and what joined it: it moved towards visual KV
    layer = changed.index(True)
    before, after = plain.prefix.values[layer], out["text_and_visual"].prefix.values[layer]
    moved = (before - after).abs().amax(dim=(0, 2)) > 0
    assert 0 < int(moved.sum()) <= before.shape[1]


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_finish_reads_the_guidance_rows_entropy_head_by_head_on_a_real_stream(backbones, model):
    """MEDA's finish on a streamed cache (M-RoPE on Qwen2-VL): the text-to-visual entropy its
    reducers gather equals the one written out from every head's attention rows."""
    from mmkv_cli.methods import Budget, EncodeContext
    from mmkv_cli.methods.meda import MedaMemory, head_entropy_total
    from tests.helpers import with_policy

    media = load_media("samples/clip.mp4", fps=8, max_frames=16)
    choice = choose("meda", budget=0.25, chunk_frames=8)
    policy = MedaMemory(choice.params, Budget(share=0.25), EncodeContext("video"))
    seen = {}
    finish = policy.finish

    def watched(state):
        guidance = policy.context.guidance(policy.params.guidance_prompt)
        for heads in ("per_head", "head_mean"):
            means = state.attend(
                guidance, reducers={"e": lambda block, h=heads: head_entropy_total(block, h)}
            )
            seen[heads] = [float(m["e"]) for m in means]
        rows, visual, _ = state.attend(guidance, rows=True)  # head-averaged rows, written out
        seen["rows"] = [float(row_entropy(r, v).mean()) for r, v in zip(rows, visual)]
        finish(state)

    policy.finish = watched
    encode_media(backbones[model], media, with_policy(choice, policy))
    assert seen["head_mean"] == pytest.approx(seen["rows"], rel=1e-4, abs=1e-5)
    # each head's own entropy is never above that of the heads' mean (concavity); a tiny random
    # model's rows are near uniform, so the two are close, but not equal
    assert all(p <= m + 1e-5 for p, m in zip(seen["per_head"], seen["head_mean"]))
    assert any(p < m - 1e-5 for p, m in zip(seen["per_head"], seen["head_mean"]))
