"""SnapKV, H2O, PyramidKV at encode (visual tokens only), and attention over per-layer key
lengths."""

import pytest
import torch

from mmkv_cli import api
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.kernels.attention import own_length_mask
from mmkv_cli.media import load_media
from mmkv_cli.methods.pyramidkv import pyramid_budgets
from mmkv_cli.methods.scoring import accumulate, pooled
from tests.helpers import choose


def test_pooling_spreads_a_peak_to_its_neighbours_only():
    scores = torch.zeros(12)
    scores[5] = 1.0
    out = pooled(scores, 7)
    assert out.shape == scores.shape
    assert out[2:9].tolist() == [1.0] * 7 and out[:2].sum() == 0 and out[9:].sum() == 0


def test_pyramid_budgets_fall_with_depth_and_average_the_budget():
    budgets = pyramid_budgets(28, 400, beta=20)
    assert budgets[0] > budgets[14] > budgets[-1]
    assert budgets[-1] == 20 and budgets[0] == 780
    assert abs(sum(budgets) - 28 * 400) <= 28
    assert pyramid_budgets(4, 1000, beta=20, available=1000) == [1000] * 4
    # over half the tokens, KVCache-Factory (the authors' code) gives every layer the same budget
    # before its clamp could act (q_len < 2 x (capacity - window): SnapKV's uniform budgets)
    assert pyramid_budgets(4, 800, beta=20, available=1000) == [800] * 4
    assert pyramid_budgets(4, 500, beta=20, available=1000)[0] == 975  # at half: still a pyramid
    # mmkv's earlier reading: the top capped at what there is, the rest rising, the average held
    high = pyramid_budgets(4, 800, beta=20, available=1000, large_budget="clamp")
    assert high[0] == 1000 and high[0] > high[-1] and abs(sum(high) - 4 * 800) <= 4


def test_h2o_accumulates_attention_into_stream_slots_after_eviction():
    total = torch.zeros(6)
    accumulate(total, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 2]))
    # token 1 was evicted meanwhile
    accumulate(total, torch.tensor([0.5, 0.5, 1.0]), torch.tensor([0, 2, 5]))
    assert total.tolist() == [1.5, 2.0, 3.5, 0.0, 0.0, 1.0]


def test_a_layer_with_fewer_keys_gets_its_own_causal_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    model_mask = torch.ones(1, 1, 3, 9, dtype=torch.bool).tril(6)  # built for a longer layer 0
    mask = own_length_mask(q, k, model_mask)
    assert mask.shape[-1] == 5
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for row in range(3):  # row i is the (5 - 3 + i)-th key: it sees keys 0 .. 2 + i
        seen = 3 + row
        weights = (q[:, :, row : row + 1] @ k[:, :, :seen].transpose(-1, -2) / 8**0.5).softmax(-1)
        assert torch.allclose(out[:, :, row : row + 1], weights @ v[:, :, :seen], atol=1e-6)
    # one query row sees everything: no mask needed
    assert own_length_mask(q[:, :, :1], k, None) is None


def test_h2o_scores_do_not_depend_on_the_chunking(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media("samples/clip.mp4", fps=8, max_frames=16)
    kept = []
    for chunk in (4, 16):
        out = encode_media(backbone, media, choose("h2o", budget=0.25, chunk_frames=chunk))
        kept.append(
            [torch.cat([b.positions[layer] for b in out.blocks], dim=1) for layer in range(4)]
        )
    assert all(torch.equal(a, b) for a, b in zip(*kept))


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
@pytest.mark.parametrize("method", ["snapkv", "h2o", "pyramidkv"])
def test_baselines_keep_their_per_layer_budgets_and_answer(tmp_path, backbones, model, method):
    backbone = backbones[model]
    full = api.encode("samples/clip.mp4", tmp_path / "full.kvpack", backbone=backbone)
    options = EncodeOptions(method, budget=0.25)
    info = api.encode("samples/clip.mp4", tmp_path / "m.kvpack", options, backbone=backbone)
    total = info["visual_tokens_total"]
    kept = [layer["tokens_kept"] for layer in info["layers"]]
    expected = pyramid_budgets(4, total // 4, 20) if method == "pyramidkv" else [total // 4] * 4
    assert kept == expected
    assert info["prompt_tokens"] == full["prompt_tokens"]  # text is never pruned
    answer = api.ask(
        tmp_path / "m.kvpack",
        "what color is the circle ?",
        AskOptions(generation=GenerationOptions(2), keep_logits=True),
        backbone=backbone,
    )
    assert answer.context_tokens < full["prompt_tokens"] + total
    assert torch.isfinite(answer.first_logits).all()


def test_recorded_attention_returns_what_sdpa_returns_and_records_the_same_scores():
    """Recording every row's attention computes the layer's output from those same probabilities
    (no second pass over QK^T); it must equal SDPA's output, with grouped KV heads and a cache."""
    from types import SimpleNamespace

    from mmkv_cli.kernels import attention
    from mmkv_cli.kernels.attention import Recorder, causal_column_sums, recording

    torch.manual_seed(1)
    query, key, value = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    expanded = [t.repeat_interleave(2, dim=1) for t in (key, value)]
    mask = own_length_mask(query, key, None)
    sdpa = torch.nn.functional.scaled_dot_product_attention(query, *expanded, attn_mask=mask)
    recorder = Recorder(layers={0}, column_sums=True, rows=True)  # rows ride along the fused pass
    with recording(recorder):
        out, _ = attention._attention(SimpleNamespace(layer_idx=0), query, key, value, None)
    assert out.shape == (2, 5, 4, 8) and torch.allclose(out.transpose(1, 2), sdpa, atol=1e-5)
    assert torch.allclose(recorder.column_sum[0], causal_column_sums(query, key, 8**-0.5))
    assert torch.allclose(recorder.row[0].sum(dim=-1), torch.ones(2, 5))  # each row a distribution


@pytest.mark.parametrize("method", ["h2o", "meda"])
def test_scoring_every_8th_row_keeps_nearly_the_tokens_every_row_keeps(tmp_path, method):
    """score_every: 8 is an estimate of the column sums. On the trained demo-grid backbone (real
    attention, not random weights) it must pick nearly the same heavy hitters as every row does;
    on this clip 94-100% of each layer's kept tokens were the same when it was written."""
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.study.synth import write_dataset

    write_dataset(tmp_path / "set", clips=1, frames=48, seed=2060, world_name="grid")
    backbone = load_backbone(LoadOptions("demo-grid", "cpu"))
    media = load_media(str(tmp_path / "set" / "clips" / "clip_0000.mp4"), fps=8, max_frames=48)
    kept = []
    for every in (1, 8):
        out = encode_media(backbone, media, choose(method, budget=0.2, score_every=every))
        layers = len(out.blocks[0].positions)
        kept.append(
            [
                set(torch.cat([b.positions[layer] for b in out.blocks], dim=1)[0].tolist())
                for layer in range(layers)
            ]
        )
    exact, sampled = kept
    assert [len(a) for a in exact] == [len(b) for b in sampled]
    assert all(len(a & b) >= 0.85 * len(a) for a, b in zip(exact, sampled))
    assert exact != sampled  # it is an estimate: some choices differ
