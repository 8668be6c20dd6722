"""AirCache scoring on hand-made tensors; pruning at ask and at encode end to end."""

import math

import pytest
import torch

from mmkv_cli.methods.aircache import (
    elite_window,
    fit_shares,
    layer_ratios,
    skewness,
    visual_importance,
)
from tests.helpers import ask_pack, encode_pack


def test_elite_window_keeps_exactly_the_tokens_above_tau_times_max():
    row = torch.tensor([0.05, 0.30, 0.27, 0.10, 0.28])
    assert elite_window(row, 0.9).tolist() == [1, 2, 4]  # 0.27 = 0.9 x 0.30 is in, 0.10 is not
    assert elite_window(row, 1.0).tolist() == [1]


def test_visual_importance_is_the_elite_rows_attention_renormalised_over_visual_and_elite_keys():
    # keys: [prompt 0 | visual 1..3 | instruction 4..6]; rows are the instruction's three tokens
    rows = torch.tensor(
        [
            [0.2, 0.1, 0.1, 0.1, 0.5, 0.0, 0.0],
            [0.1, 0.0, 0.3, 0.1, 0.2, 0.3, 0.0],
            [
                0.1,
                0.2,
                0.0,
                0.1,
                0.1,
                0.5,
                0.0,
            ],  # the last token: elite = instruction token 1 only (0.5)
        ]
    )
    importance = visual_importance(rows, slice(1, 4), slice(4, 7), tau=0.9)
    elite = rows[1]  # the row of instruction token 1
    expected = elite[1:4] / (elite[1:4].sum() + elite[5])
    assert torch.allclose(importance, expected)


def test_layer_budgets_follow_strength_and_skew_and_keep_the_total():
    flat = torch.full((100,), 0.001)  # weak and even: little to gain from keeping much
    peaked = torch.full((100,), 0.001)
    peaked[:3] = 0.3  # strong and skewed
    ratios = layer_ratios([flat, peaked, flat * 2], ratio=0.1, low=0.01)
    assert sum(ratios) / 3 == pytest.approx(0.1)
    assert ratios[1] > ratios[2] >= ratios[0] >= 0.01
    assert skewness(peaked) > skewness(flat) == 0.0
    shares = fit_shares([10.0, 1.0, 1.0, 0.0], mean=0.4, low=0.05, high=1.0)
    assert shares[0] == 1.0 and min(shares) == 0.05 and sum(shares) / 4 == pytest.approx(0.4)
    assert fit_shares([5.0, 1.0, 0.0], mean=1.0, low=0.01, high=1.0) == [
        1.0,
        1.0,
        1.0,
    ]  # everything kept


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_pruning_at_ask_keeps_the_first_token_and_cuts_each_layer(tmp_path, backbones, model):
    backbone = backbones[model]
    pack = tmp_path / "full.kvpack"
    info = encode_pack("samples/clip.mp4", pack, model, "full", backbone=backbone)
    question = "what color is the circle ?"
    plain = ask_pack(pack, question, backbone=backbone, max_new_tokens=4, keep_logits=True)
    whole = ask_pack(
        pack, question, backbone=backbone, max_new_tokens=4, prune="snapkv", budget=1.0
    )
    assert whole.token_ids == plain.token_ids  # keeping everything changes nothing
    n_question = len(backbone.question_ids(question))
    text = info["prompt_tokens"] + n_question
    for method in ("aircache", "snapkv", "pyramidkv"):
        pruned = ask_pack(
            pack,
            question,
            backbone=backbone,
            max_new_tokens=4,
            keep_logits=True,
            prune=method,
            budget=0.25,
        )
        assert torch.equal(
            pruned.first_logits, plain.first_logits
        )  # the question saw the whole context
        visual = [n - text for n in pruned.kv_tokens]
        assert all(1 <= v < info["visual_tokens_total"] for v in visual)
        if method == "snapkv":
            assert visual == [math.floor(0.25 * info["visual_tokens_total"])] * 4
        else:
            assert sum(visual) == pytest.approx(0.25 * 4 * info["visual_tokens_total"], abs=8)
            assert len(set(visual)) > 1  # layers differ


def test_aircache_at_encode_keeps_the_budget_on_average(tmp_path, backbones):
    info = encode_pack(
        "samples/clip.mp4",
        tmp_path / "a.kvpack",
        "tiny-qwen2-vl",
        "aircache",
        budget=0.25,
        backbone=backbones["tiny-qwen2-vl"],
    )
    kept = [layer["tokens_kept"] for layer in info["layers"]]
    assert sum(kept) == pytest.approx(0.25 * 4 * info["visual_tokens_total"], abs=4)
    answer = ask_pack(
        tmp_path / "a.kvpack",
        "what color is the circle ?",
        backbone=backbones["tiny-qwen2-vl"],
        max_new_tokens=2,
    )
    assert answer.context_tokens > 0
