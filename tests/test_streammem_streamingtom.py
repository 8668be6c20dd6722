"""StreamMem and StreamingTOM: StreamMem's choice and prototypes on tensors, and what each method's
pack holds at its own settings."""

import torch

from mmkv_cli.methods import streammem
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES
from tests.helpers import ask_pack, encode_pack


def test_a_prototype_is_the_attention_weighted_mean_of_its_frame():
    keys = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    values = -keys
    key, value = streammem.prototype(keys, values, torch.tensor([1.0, 0.0, 3.0]))
    assert torch.allclose(key, 0.25 * keys[:, 0] + 0.75 * keys[:, 2])
    assert torch.allclose(value, -key)
    flat, _ = streammem.prototype(keys, values, torch.zeros(3))  # no attention: a plain mean
    assert torch.allclose(flat, keys.mean(dim=1))


def test_prototypes_are_kept_beside_the_budget_best_scored():
    scores = torch.tensor([0.1, 0.9, 0.0, 0.5, 0.7, 0.2])
    protected = torch.tensor([False, False, True, False, False, True])
    assert streammem.kept_entries(scores, protected, 2).tolist() == [1, 2, 4, 5]
    assert streammem.kept_entries(scores, protected, 0).tolist() == [2, 5]


def test_streammem_holds_its_budget_and_one_prototype_a_frame(tmp_path, backbones):
    backbone = backbones["tiny-llava-ov"]
    info = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "p.kvpack",
        method="streammem",
        budget_tokens=8,
        backbone=backbone,
        fps=2.0,
    )
    frames = info["media"]["frames"]
    assert [layer["tokens_kept"] for layer in info["layers"]] == [8 + frames] * len(info["layers"])
    answer = ask_pack(tmp_path / "p.kvpack", "what shape?", backbone=backbone, keep_logits=True)
    assert torch.isfinite(answer.first_logits).all()


def test_streamingtom_stores_its_reduced_frames_at_four_bits_and_retrieves_frames(
    tmp_path, backbones
):
    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "p.kvpack"
    info = encode_pack(SAMPLES / "clip.mp4", pack, method="streamingtom", backbone=backbone)
    grid = PackReader(pack).header.layout.tokens_per_step
    frames = info["media"]["frames"]  # one frame a step on LLaVA-OV
    assert info["kv_bits"] == 4 and info["reduce"] == "ctr"
    assert info["visual_tokens_prefilled"] == round(50 / 196 * grid) * frames
    assert info["visual_tokens_kept"] == info["visual_tokens_prefilled"]
    sixteen = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "q.kvpack",
        method="streamingtom",
        backbone=backbone,
        kv_bits=16,
    )
    assert info["kv_bytes"] < 0.3 * sixteen["kv_bytes"]
    answer = ask_pack(pack, "what shape?", backbone=backbone)
    assert 0 < len(answer.retrieved) <= 251 and all(
        r["granularity"] == "frame" for r in answer.retrieved
    )
