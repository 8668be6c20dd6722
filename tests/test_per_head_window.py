"""SnapKV and PyramidKV per KV head (issue 72), as KVCache-Factory's code keeps them: each KV head
its own top-k by its own pooled window attention (its query heads' mean); `selection: per_layer`
the top of the pooled mean over the heads. The references are the definitions, on the scores the
encode computed."""

import pytest
import torch

from mmkv_cli.core.options import MethodSpec
from mmkv_cli.methods import pyramidkv, snapkv
from mmkv_cli.methods.scoring import pooled, top_per_head
from mmkv_cli.pack import PackReader
from tests.helpers import encode_pack


def test_pooling_a_head_at_a_time():
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0]])
    got = pooled(scores, 3)
    for head in range(2):
        assert torch.equal(got[head], pooled(scores[head], 3))
    assert got[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]  # no bleed from the other head


def names(reader) -> list[str]:
    return [reader.blocks.name(i) for i in range(len(reader.blocks))]


@pytest.mark.parametrize(
    ("module", "memory"), [(snapkv, "SnapKVMemory"), (pyramidkv, "PyramidKVMemory")]
)
def test_each_kv_head_keeps_the_top_of_its_own_window_attention(
    tmp_path, clip, monkeypatch, module, memory
):
    attention, seen = [], {}
    original_pool, original_scores = module.window_scores, getattr(module, memory).layer_scores

    def keep_attention(layers, kernel):
        attention.append(layers)
        return original_pool(layers, kernel)

    def keep_scores(self, state):
        scores = original_scores(self, state)
        seen[self.params.selection] = (scores, [p.clone() for p in state.cache.positions])
        return scores

    monkeypatch.setattr(module, "window_scores", keep_attention)
    monkeypatch.setattr(getattr(module, memory), "layer_scores", keep_scores)
    packs = {}
    for selection in ("per_head", "per_layer"):
        packs[selection] = tmp_path / f"{selection}.kvpack"
        spec = MethodSpec(module.METHOD.name, {"selection": selection})
        encode_pack(clip, packs[selection], "demo", spec, 0.25, max_frames=8)
    heads_attention, layer_attention = attention
    reader = PackReader(packs["per_head"])
    heads = reader.header.kv.kv_heads
    assert reader.header.kv.per_head and heads > 1
    scores, positions = seen["per_head"]
    for layer, layer_scores in enumerate(scores):
        # a KV head's attention is its query heads' mean, so the heads' mean is the layer's
        torch.testing.assert_close(
            heads_attention[layer].mean(0), layer_attention[layer], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(layer_scores, pooled(heads_attention[layer], 7))
        for head in range(heads):
            stored = torch.cat(
                [reader.span(n).positions[layer * heads + head] for n in names(reader)], dim=1
            )
            want = positions[layer][:, top_per_head(layer_scores, stored.shape[1])[head]]
            assert torch.equal(stored, want)  # in time order, as the blocks hold them
    per_layer = PackReader(packs["per_layer"])
    assert not per_layer.header.kv.per_head
    mean_scores, mean_positions = seen["per_layer"]
    for layer, layer_scores in enumerate(mean_scores):
        torch.testing.assert_close(layer_scores, pooled(layer_attention[layer], 7))
        stored = torch.cat([per_layer.span(n).positions[layer] for n in names(per_layer)], dim=1)
        want = layer_scores.topk(stored.shape[1]).indices.sort().values
        assert torch.equal(stored, mean_positions[layer][:, want])
