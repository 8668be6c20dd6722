"""HERMES: layered scores on hand-made tensors, the summary token, lazy/eager positions, the budget
held."""

import json
import math
import subprocess
import sys

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.kernels.rope import rotate_keys
from mmkv_cli.media import load_media
from mmkv_cli.methods import Budget, EncodeContext
from mmkv_cli.methods.hermes import HermesMemory, HermesParams, curves_for, mix_for
from mmkv_cli.methods.hermes_scoring import (
    fold_into_summary,
    layer_roles,
    layer_score,
    recency_curve,
    smooth_deep_to_shallow,
)
from mmkv_cli.methods.running_cache import RunningCache
from mmkv_cli.methods.scoring import top_in_order
from mmkv_cli.pack import PackReader
from tests.helpers import choose, encode_pack, with_policy

PARAMS = HermesParams()


def test_layer_split_and_depth_interpolation_follow_the_authors_code():
    """Shallow: the first int(0.1 L) layers; deep from int(0.7 L); middle layer i of n: p = i/n."""
    for layers, shallow, deep in ((28, 2, 9), (24, 2, 8), (32, 3, 10), (10, 1, 3)):
        roles = [r for r, _ in layer_roles(layers, 0.1, 0.3)]
        assert roles.count("shallow") == shallow and roles.count("deep") == deep, layers
        assert roles == sorted(roles, key=["shallow", "middle", "deep"].index)
    middle = [p for r, p in layer_roles(28, 0.1, 0.3) if r == "middle"]
    assert len(middle) == 17 and middle[0] == 0.0 and middle[-1] == pytest.approx(16 / 17)
    llava = curves_for(PARAMS, "llava_onevision")
    assert mix_for("middle", 0.0, llava) == (1.0, 20.0)
    a, k = mix_for("middle", 1.0, llava)
    assert a == pytest.approx(0.1) and k == pytest.approx(0.5)
    assert mix_for("shallow", 0.0, llava)[0] == 1.0 and mix_for("deep", 1.0, llava)[0] == 0.0
    assert [r for r, _ in layer_roles(4, 0.1, 0.3)] == ["middle", "middle", "deep", "deep"]


@pytest.mark.parametrize(
    ("family", "a", "k"),
    [  # the authors' files at commit 8d699b1, written out: a(p), k(p) over a middle layer's depth
        ("llava_onevision", lambda p: 1 - 0.9 * p, lambda p: 20 - 19.5 * p),
        ("qwen2_vl", lambda p: 0.75 - 0.6 * p, lambda p: 20 - 12 * p),
        ("qwen2_5_vl", lambda p: 0.75 - 0.6 * p, lambda p: 20 - 12 * p),
        ("qwen3_vl", lambda p: 0.75 - 0.6 * p, lambda p: 20 - 12 * p),
    ],
)
def test_middle_layers_weigh_recency_as_the_authors_file_for_the_backbone_does(family, a, k):
    curves = curves_for(PARAMS, family)
    for p in (0.0, 0.25, 0.5, 16 / 17):
        got = mix_for("middle", p, curves)
        assert got == pytest.approx((a(p), k(p)), abs=1e-12), (family, p)
    # one file for every backbone, and fields set over it, as options
    llava_everywhere = curves_for(HermesParams(curves="llava_ov"), family)
    assert mix_for("middle", 0.5, llava_everywhere) == pytest.approx((0.55, 10.25))
    own = curves_for(HermesParams(recency_k=(10.0, 1.0)), family)
    assert mix_for("middle", 1.0, own)[1] == pytest.approx(1.0)
    assert own["middle_a"] == curves["middle_a"]


def test_recency_wins_in_shallow_layers_and_an_attended_old_token_survives_in_deep_ones():
    attention = torch.full((10,), 0.01)
    attention[1] = 5.0  # an old token the guidance prompt looks at
    curves = curves_for(PARAMS, "llava_onevision")
    shallow = top_in_order(layer_score(attention, *mix_for("shallow", 0, curves)), 3)
    deep = top_in_order(layer_score(attention, *mix_for("deep", 1, curves)), 3)
    assert shallow.tolist() == [7, 8, 9]
    assert 1 in deep.tolist()
    curve = recency_curve(5, 20.0)
    assert curve[-1] == 1.0 and bool((curve[1:] > curve[:-1]).all())
    assert curve[0].item() == pytest.approx(math.exp(-20.0))  # age normalised by n - 1


def test_smoothing_pulls_a_shallow_choice_towards_the_deeper_layer():
    kept = [torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2])]
    shallow = torch.tensor([0.0, 0.55, 0.5])  # alone it keeps token 1
    deep = torch.tensor([0.0, 0.0, 1.0])  # the deeper layer wants token 2
    smoothed = smooth_deep_to_shallow([shallow, deep], kept, [0.3, 0.4], total=3)
    assert int(shallow.argmax()) == 1 and int(smoothed[0].argmax()) == 2
    assert torch.equal(smoothed[1], deep)  # the deepest layer is not changed
    # Tokens are matched by stream index, not by slot: the deeper layer lost token 0 and holds 2, 5.
    kept = [torch.tensor([0, 2, 5]), torch.tensor([2, 5])]
    out = smooth_deep_to_shallow(
        [torch.tensor([0.9, 0.2, 0.2]), torch.tensor([0.0, 1.0])], kept, [0.5, 0.4], 6
    )
    assert out[0].tolist() == pytest.approx([0.9, 0.1, 0.6])


def test_summary_token_is_the_mean_of_evicted_keys_rotated_to_the_summary_slot():
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8) / 8))
    axes = torch.zeros(8, dtype=torch.long)
    raw = torch.randn(2, 5, 16)  # keys before RoPE
    positions = torch.tensor([[3, 9, 14, 20, 41]])
    stored = rotate_keys(raw, positions, inv_freq, axes)  # as the cache holds them
    values = torch.randn(2, 5, 16)
    target = torch.tensor([2])
    key, value, count = fold_into_summary(stored, values, positions, target, inv_freq, axes)
    expected = rotate_keys(raw, target.view(1, 1).expand(1, 5), inv_freq, axes).mean(
        dim=1, keepdim=True
    )
    assert count == 5
    assert torch.allclose(key, expected, atol=1e-5)
    assert torch.allclose(value, values.mean(dim=1, keepdim=True), atol=1e-6)
    # Folding in two rounds is the same running mean as folding all at once.
    first = fold_into_summary(
        stored[:, :2], values[:, :2], positions[:, :2], target, inv_freq, axes
    )
    second = fold_into_summary(
        stored[:, 2:], values[:, 2:], positions[:, 2:], target, inv_freq, axes, first
    )
    assert (
        second[2] == 5
        and torch.allclose(second[0], key, atol=1e-5)
        and torch.allclose(second[1], value)
    )
    # Across compressions the slot moves (after the layer's last kept token): the summary is
    # rotated by the move, then the next evictions fold in; it stays the mean of every evicted key
    # rotated to the final slot, each counted once.
    moved_to = torch.tensor([57])
    carried = rotate_keys(first[0], (moved_to - target).view(1, 1), inv_freq, axes)
    third = fold_into_summary(
        stored[:, 2:],
        values[:, 2:],
        positions[:, 2:],
        moved_to,
        inv_freq,
        axes,
        (carried, first[1], first[2]),
    )
    at_end = rotate_keys(raw, moved_to.view(1, 1).expand(1, 5), inv_freq, axes).mean(
        dim=1, keepdim=True
    )
    assert third[2] == 5 and torch.allclose(third[0], at_end, atol=1e-5)
    assert torch.allclose(third[1], value, atol=1e-6)


def _encode(backbone, media, reindex: str, budget_tokens: int, chunk: int = 4, **params):
    choice = choose(
        "hermes", budget_tokens=budget_tokens, reindex=reindex, chunk_frames=chunk, **params
    )
    return encode_media(backbone, media, choice)


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_eager_reindex_compacts_positions_and_rerotates_keys_lazy_keeps_them(backbones, model):
    backbone = backbones[model]
    media = load_media("samples/clip.mp4", fps=8, max_frames=32)
    full = _encode(
        backbone, media, "lazy", budget_tokens=10_000
    )  # never over budget: the reference
    full_keys = torch.cat([b.keys[0] for b in full.blocks], dim=1)
    full_pos = torch.cat([b.positions[0] for b in full.blocks], dim=1)
    inv_freq, axes = backbone.rope_tables()
    per_step = full.layout["tokens_per_step"]
    for mode in ("lazy", "eager"):
        # as mmkv placed the stream before issue 72: the next chunk at the stream's next position
        out = _encode(backbone, media, mode, budget_tokens=3 * per_step, continue_at="stream")
        keys = torch.cat(
            [b.keys[0] for b in out.blocks], dim=1
        )  # layer 0: keys depend on token + position only
        pos = torch.cat([b.positions[0] for b in out.blocks], dim=1)
        assert keys.shape[1] == 3 * per_step
        if mode == "lazy":  # original positions, keys untouched
            for j in range(pos.shape[1]):
                same = (full_pos == pos[:, j : j + 1]).all(dim=0).nonzero()
                assert len(same) == 1
                assert torch.allclose(full_keys[:, same[0, 0]], keys[:, j], atol=1e-5)
            assert out.layout["position_shift"] == 0
            continue
        prefix = out.prefix.layer_counts[0]
        assert (
            int(pos[0].min()) == prefix and int(pos[0].max()) < prefix + keys.shape[1]
        )  # compacted
        assert out.layout["next_position"] > int(
            pos.max()
        )  # the question comes after the compacted stream
        if backbone.position_dims == 1:
            assert (
                out.layout["next_position"]
                == prefix + keys.shape[1] + 1 + out.suffix.layer_counts[0]  # 1: the summary slot
            )
            assert out.layout["position_shift"] > 0
        for j in range(pos.shape[1]):  # every kept key is some stream key rotated to its new slot
            moved = rotate_keys(full_keys, pos[:, j : j + 1] - full_pos, inv_freq, axes)
            assert float((moved - keys[:, j : j + 1]).abs().amax(dim=(0, 2)).min()) < 1e-4


@pytest.mark.parametrize("model", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_a_running_mean_summary_streams_on_in_front_of_the_deep_layers(backbones, model):
    """summary_as: running_mean (mmkv's reading before issue 51): one summary a deep layer, in
    front of the stream, the count-weighted mean of everything folded, never scored."""
    backbone = backbones[model]
    media = load_media("samples/clip.mp4", fps=8, max_frames=32)
    choice = choose("hermes", budget_tokens=40, chunk_frames=4, summary_as="running_mean")
    policy = HermesMemory(choice.params, Budget(tokens=40), EncodeContext("video"))
    layers = backbone.text_config.num_hidden_layers
    roles = [role for role, _ in layer_roles(layers, PARAMS.shallow_share, PARAMS.deep_share)]
    snapshots = []
    compress = policy.after_chunk

    def after_chunk(state):
        compress(state)
        if not policy.summary:
            return
        lengths = [int(e.keys.shape[2]) for e in state.cache.cache.layers]
        prompt = state.cache.prompt_len
        fronts = [state.cache.cache.layers[i].keys[0, :, prompt].clone() for i in policy.summary]
        attention = state.attend(policy.context.guidance())
        kept = [state.cache.count(layer) for layer in range(state.layers)]
        snapshots.append((lengths, kept, fronts, [len(a) for a in attention]))

    policy.after_chunk = after_chunk
    out = encode_media(backbone, media, with_policy(choice, policy))
    assert len(snapshots) >= 2  # compressed, then streamed on and compressed again
    prefix = out.prefix.layer_counts[0]
    for lengths, kept, _, attended in snapshots:
        assert (
            attended == kept
        )  # the guidance prompt's scores line up with the visual tokens, not the summary
        for layer, role in enumerate(roles):
            if role == "deep":  # prompt, summary, budget - 1 visual tokens
                assert kept[layer] == 39 and lengths[layer] == prefix + 1 + kept[layer]
            else:
                assert kept[layer] == 40 and lengths[layer] == prefix + kept[layer]
    summary = out.blocks[-1]  # after the kept tokens, in time and in position
    deep = [layer for layer, role in enumerate(roles) if role == "deep"]
    assert summary.granularity == "summary" and sorted(policy.summary) == deep
    for layer in deep:
        kept = torch.cat([b.positions[layer] for b in out.blocks[:-1]], dim=1)
        assert summary.positions[layer].flatten().tolist() == [int(kept.max()) + 1] * len(kept)
    # eager compaction left the slot after the summary to the suffix
    assert int(out.suffix.positions[0].min()) > max(
        int(summary.positions[layer].max()) for layer in deep
    )
    for layer, front in zip(
        sorted(policy.summary), snapshots[-1][2]
    ):  # the pack's summary is the cache's
        assert torch.equal(summary.keys[layer][:, 0], front)


def test_the_summary_can_sit_right_after_the_prompt_instead(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media("samples/clip.mp4", fps=8, max_frames=32)
    choice = choose(
        "hermes", budget_tokens=40, chunk_frames=4, summary_at="after_prompt",
        summary_as="running_mean",
    )  # fmt: skip
    out = encode_media(backbone, media, choice)
    summary = out.blocks[0]
    prefix = out.prefix.layer_counts[0]
    assert summary.granularity == "summary" and summary.steps == (0, 0)
    for layer, slot in enumerate(summary.positions):  # right after the layer's prompt (which
        if slot.numel():  # moves with its layer as a whole: continue_at layer_end)
            assert int(slot.max()) == int(out.prefix.positions[layer].max()) + 1
    assert int(out.prefix.positions[0].max()) + 1 == prefix  # the shallow layer never moved


def test_pack_never_exceeds_the_budget_over_a_long_stream_and_ask_runs_in_a_new_process(
    tmp_path, backbones
):
    from mmkv_cli.study.synth import write_dataset

    write_dataset(tmp_path / "set", clips=1, frames=256, seed=2, kind="normal")
    video = str(tmp_path / "set" / "clips" / "clip_0000.mp4")
    backbone = backbones["tiny-llava-ov"]
    budget = 96
    pack = tmp_path / "h.kvpack"
    info = encode_pack(
        video, pack, method="hermes", budget_tokens=budget, max_frames=256, backbone=backbone
    )
    assert info["visual_tokens_total"] == 256 * 16
    assert all(layer["tokens_kept"] <= budget for layer in info["layers"])
    assert (
        info["layers"][-1]["tokens_kept"] == budget
    )  # deep: budget - 1 tokens + the summary token
    assert "summary" not in info["granularities"]  # ordinary tokens, in their steps' blocks
    kv = PackReader(pack).header.kv
    per_token = 2 * kv.kv_heads * kv.head_dim * 4 * kv.layers
    chunk_tokens = 16 * 16
    assert info["peak_kv_bytes"] <= (info["prompt_tokens"] + budget + chunk_tokens + 32) * per_token
    assert math.isclose(
        info["kv_bytes"], sum(layer["tokens_kept"] for layer in info["layers"]) * per_token / 4
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmkv_cli",
            "ask",
            str(pack),
            "how many shapes appeared ?",
            "--json",
            "--max-new-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["ttft_s"] > 0 and "retrieved" not in answer  # listed with --explain only
    assert answer["context_tokens"] <= info["prompt_tokens"] + budget + 1 + 16


def test_token_and_share_budgets_are_checked_and_presets_extend_the_method():
    from mmkv_cli.core.errors import UsageError

    with pytest.raises(UsageError, match="keeps every token"):
        choose("full", budget_tokens=100)
    with pytest.raises(UsageError, match="at least 1"):
        choose("hermes", budget_tokens=0)
    assert choose("recency", budget_tokens=100).budget == Budget(tokens=100)
    assert choose("hermes", budget=0.25).budget == Budget(share=0.25)
    six = choose("hermes-6k")
    assert six.budget == Budget(tokens=6144) and six.params == HermesParams()


def test_a_token_budget_above_the_stream_evicts_nothing(tmp_path, backbones):
    info = encode_pack(
        "samples/clip.mp4",
        tmp_path / "h.kvpack",
        method="hermes-6k",
        backbone=backbones["tiny-llava-ov"],
    )
    assert info["budget_tokens"] == 6144 and "summary" not in info["granularities"]
    assert all(layer["tokens_kept"] == info["visual_tokens_total"] for layer in info["layers"])


def _one_deep_layer(keys: torch.Tensor, positions: list[int], inv_freq, axes):
    """A running cache of one layer (deep, as HERMES splits 1 layer): a 2-token prompt, then
    visual keys [1, n, D] at `positions`, stream indices 0..n-1; values are the keys times 2."""
    from transformers import DynamicCache

    from mmkv_cli.methods.running_cache import RunningCache, StreamState

    cache = DynamicCache()
    prompt = torch.zeros(1, 1, 2, keys.shape[-1])
    cache.update(prompt, prompt.clone(), 0)
    running = RunningCache(cache, prompt_len=2, position_dims=1)
    state = StreamState(
        cache=running,
        token_step=torch.arange(16),
        layout_positions=torch.arange(2, 19).view(1, -1),
        total=16,
        rope=(inv_freq, axes),
    )
    _append(state, keys, positions)
    return state


def _append(state, keys: torch.Tensor, positions: list[int]) -> None:
    start = state.seen
    state.cache.cache.update(keys[None], 2 * keys[None], 0)
    index = torch.arange(start, start + keys.shape[1])
    state.cache.appended(index, torch.tensor([positions]))
    state.seen += keys.shape[1]


def test_a_summary_token_is_scored_evicted_and_folded_again_with_weight_one():
    """summary_as: token (the authors' code): each compression appends the mean of what a deep
    layer evicts, rotated to the slot after its last kept token, as an ordinary cached token; a
    later compression that evicts it folds it in as one token among the others."""
    torch.manual_seed(1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 4) / 4))
    axes = torch.zeros(4, dtype=torch.long)
    raw = torch.randn(1, 8, 8)  # keys before RoPE, one KV head
    stored = rotate_keys(raw, torch.arange(2, 10).view(1, -1), inv_freq, axes)
    state = _one_deep_layer(stored[:, :6], list(range(2, 8)), inv_freq, axes)
    attention = [torch.tensor([0.9, 0.1, 0.8, 0.2, 0.7, 0.6])]
    state.attend = lambda texts, **how: [attention for _ in texts]
    params = HermesParams(reindex="lazy")
    policy = HermesMemory(params, Budget(tokens=4), EncodeContext("video"))

    def rotated_to(target: int, keys: torch.Tensor, at: list[int]) -> torch.Tensor:
        return rotate_keys(keys, torch.tensor([[target - p for p in at]]), inv_freq, axes)

    policy.after_chunk(state)  # 6 > 4: keep the best 3 (tokens 0, 2, 4), fold 1, 3, 5
    keys, values = state.cache.visual(0)
    # the summary goes by the newest streamed token's index (5): into the step it was made at
    assert state.cache.index[0].tolist() == [0, 2, 4, 5]
    assert state.cache.positions[0].tolist() == [[2, 4, 6, 7]]  # after the last kept token
    assert policy.summary_mask[0].tolist() == [False, False, False, True]
    first = rotated_to(7, stored[:, [1, 3, 5]], [3, 5, 7]).mean(dim=1)
    torch.testing.assert_close(keys[:, 3], first)
    torch.testing.assert_close(values[:, 3], (2 * stored[:, [1, 3, 5]]).mean(dim=1))

    _append(state, stored[:, 6:8], [8, 9])
    # now it is scored like the others: low, so it goes, with tokens 2 and 6; token 7 stays
    attention[0] = torch.tensor([0.9, 0.05, 0.8, 0.1, 0.6, 0.7])
    policy.after_chunk(state)
    keys, values = state.cache.visual(0)
    assert state.cache.index[0].tolist() == [0, 4, 7, 7]  # token 7, and the summary made at 7
    assert state.cache.positions[0].tolist() == [[2, 6, 9, 10]]
    assert policy.summary_mask[0].tolist() == [False, False, False, True]
    gone = torch.cat([stored[:, [2]], first[:, None], stored[:, [6]]], dim=1)
    again = rotated_to(10, gone, [4, 7, 8]).mean(dim=1)  # weight 1 each, not 3 for the summary
    torch.testing.assert_close(keys[:, 3], again, atol=1e-5, rtol=1e-5)
    old_values = (2 * stored[:, [1, 3, 5]]).mean(dim=1, keepdim=True)
    folded = torch.cat([2 * stored[:, [2]], old_values, 2 * stored[:, [6]]], dim=1).mean(dim=1)
    torch.testing.assert_close(values[:, 3], folded)
    # a summary pairs with no token when scores are smoothed across layers
    ids, total = policy._smoothing_ids(state)
    assert ids[0].tolist() == [0, 4, 7, 16] and total == 17


def test_summary_tokens_go_into_the_pack_in_the_step_they_were_made_at(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media("samples/clip.mp4", fps=8, max_frames=32)
    choice = choose("hermes", budget_tokens=40, chunk_frames=4)
    policy = HermesMemory(choice.params, Budget(tokens=40), EncodeContext("video"))
    made = []
    add = RunningCache.add

    def spy(self, layer, key, value, index, position):
        made.append((layer, index, policy_state["seen"]))
        add(self, layer, key, value, index, position)

    policy_state = {}
    compress = policy._compress

    def watched(state, cap):
        policy_state["seen"] = state.seen
        compress(state, cap)

    policy._compress = watched
    RunningCache.add = spy
    try:
        out = encode_media(backbone, media, with_policy(choice, policy))
    finally:
        RunningCache.add = add
    roles = [r for r, _ in layer_roles(4, PARAMS.shallow_share, PARAMS.deep_share)]
    deep = [layer for layer, role in enumerate(roles) if role == "deep"]
    assert made and {layer for layer, *_ in made} == set(deep) and not policy.summary
    assert all(index == seen - 1 for _, index, seen in made)  # the newest streamed token's
    assert all(b.granularity == "frame" for b in out.blocks)
    for layer in range(4):  # every layer at the budget: deep ones hold their summaries in it
        assert sum(b.layer_counts[layer] for b in out.blocks) == 40
    for layer in deep:
        assert int(policy.summary_mask[layer].sum()) >= 1


def test_an_encode_takes_the_curves_of_its_backbones_family(tmp_path, backbones):
    """On a Qwen backbone the default is the Qwen file's curves (the same pack as asking for them),
    and LLaVA-OV's keep other tokens; a LLaVA-OV backbone's default is its own file's."""
    from mmkv_cli.core.options import MethodSpec

    def kept(model: str, curves: str | None) -> list[torch.Tensor]:
        out = tmp_path / f"{model}-{curves}.kvpack"
        method = MethodSpec("hermes", {"curves": curves} if curves else {})
        encode_pack("samples/clip.mp4", out, method=method, budget_tokens=8, fps=2.0, force=True,
                    backbone=backbones[model])  # fmt: skip
        reader = PackReader(out)
        return reader.gather([reader.blocks.name(i) for i in range(len(reader.blocks))])[2]

    same = zip(kept("tiny-qwen2.5-vl", None), kept("tiny-qwen2.5-vl", "qwen"), strict=True)
    assert all(torch.equal(a, b) for a, b in same)
    other = zip(kept("tiny-qwen2.5-vl", None), kept("tiny-qwen2.5-vl", "llava_ov"), strict=True)
    assert not all(torch.equal(a, b) for a, b in other)
    own = zip(kept("tiny-llava-ov", None), kept("tiny-llava-ov", "llava_ov"), strict=True)
    assert all(torch.equal(a, b) for a, b in own)
