"""recency (StreamingLLM): sinks + newest tokens, never more than the budget."""

import torch

from mmkv_cli.methods.recency import newest
from mmkv_cli.pack import PackReader
from tests.helpers import ask_pack, encode_pack


def test_newest_picks_the_tail_in_order():
    assert newest(10, 3).tolist() == [7, 8, 9]
    assert newest(2, 5).tolist() == [0, 1]
    assert newest(4, 0).tolist() == []


def test_recency_quarter_budget_keeps_newest_quarter(tmp_path, backbones, clip):
    for name, backbone in backbones.items():
        pack = tmp_path / f"{name}.kvpack"
        info = encode_pack(
            clip, pack, method="recency", budget=0.25, backbone=backbone, fps=4.0, max_frames=16
        )
        total = info["visual_tokens_total"]
        assert all(layer["tokens_kept"] <= 0.25 * total for layer in info["layers"])
        assert info["visual_tokens_kept"] == int(0.25 * total)
        reader = PackReader(pack)
        # What survives is the end of the stream: its positions are the largest ones.
        full = tmp_path / f"{name}-full.kvpack"
        encode_pack(clip, full, method="full", backbone=backbone, fps=4.0, max_frames=16)
        all_pos = torch.cat(
            [PackReader(full).span(b["name"]).positions[0] for b in PackReader(full).blocks], 1
        )
        kept_pos = torch.cat([reader.span(b["name"]).positions[0] for b in reader.blocks], 1)
        assert torch.equal(kept_pos, all_pos[:, -kept_pos.shape[1] :])
        assert PackReader(pack).size < 0.5 * PackReader(full).size
        answer = ask_pack(pack, "what happened first ?", backbone=backbone, max_new_tokens=4)
        assert (
            answer.context_tokens
            < ask_pack(
                full, "what happened first ?", backbone=backbone, max_new_tokens=1
            ).context_tokens
        )
        assert answer.ttft_s > 0
