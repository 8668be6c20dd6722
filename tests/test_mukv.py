"""MuKV and ReKV: scoring and retrieval on hand-made tensors, then end to end on every tiny
family."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from mmkv_cli import api
from mmkv_cli.methods.mukv import (
    frequency_signal,
    fused_score,
    keep_count,
    plan_blocks,
    quarter_grid,
)
from mmkv_cli.methods.retrieval import retrieve
from mmkv_cli.methods.scoring import SIMILARITY, top_in_order
from mmkv_cli.pack import PackReader
from tests.conftest import TINY
from tests.helpers import ask_pack, choose, encode_pack


@pytest.mark.parametrize("mode", ["fft", "diff"])
def test_frequency_signal_ranks_a_jump_above_a_flat_run(mode):
    keys = torch.ones(16, 8)
    keys[9] = -3.0  # one token that breaks the run
    signal = frequency_signal(keys, mode)
    assert int(signal.argmax()) == 9 or (mode == "diff" and int(signal.argmax()) in (9, 10))
    assert signal[9] > signal[2:6].max()
    if mode == "diff":  # the authors' torch.diff(k, prepend=k[:1]): the first token changed nothing
        assert signal[0] == 0 and signal[1] == 0


def test_fusion_and_top_k_keep_temporal_order_and_exact_count():
    attention = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.05, 0.7])
    frequency = torch.tensor([0.0, 0.1, 0.0, 0.0, 1.0, 0.0])
    score = fused_score(attention, frequency, alpha=0.5)
    kept = top_in_order(score, 3)
    assert kept.tolist() == sorted(kept.tolist()) and len(kept) == 3
    assert set(kept.tolist()) == {1, 3, 4}  # attention winners 1 and 3, and the frequency spike 4
    assert keep_count(49, 0.1) == 4 and keep_count(784, 0.8) == 627 and keep_count(196, 1.0) == 196
    assert keep_count(4, 0.1) == 0 and keep_count(1, 0.5) == 0  # never rounded up: not stored


def test_blocks_cover_every_token_once_per_granularity():
    grid = (4, 6)
    lengths = [2 + 24 + 1] * 5  # markers before (2) and after (1) every grid, as on Qwen3
    starts = [i * lengths[0] for i in range(5)]
    plans = plan_blocks(starts, lengths, [2] * 5, grid, segment_steps=2)
    total = sum(lengths)
    for granularity in ("patch", "frame", "segment"):
        tokens = torch.cat([p.tokens for p in plans if p.granularity == granularity])
        assert sorted(tokens.tolist()) == list(range(total)), granularity
    assert sum(p.granularity == "segment" for p in plans) == 3  # 2 + 2 + 1 steps
    assert quarter_grid(4, 6)[0].tolist() == [0, 1, 2, 6, 7, 8]  # the top-left 2 x 3 quadrant


def test_middle_frame_views_detail_only_each_segments_middle_step():
    from mmkv_cli.core.errors import UsageError
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.methods.mukv import MuKVParams

    starts, lengths = (
        [i * 4 for i in range(5)],
        [4] * 5,
    )  # five 2 x 2 steps; segments of 2 steps: 0-1, 2-3, 4
    plans = plan_blocks(starts, lengths, [0] * 5, (2, 2), segment_steps=2, views="middle_frame")
    assert [p.steps for p in plans if p.granularity == "frame"] == [(1, 2), (3, 4), (4, 5)]
    for step in (1, 3, 4):
        patches = torch.cat(
            [p.tokens for p in plans if p.granularity == "patch" and p.steps == (step, step + 1)]
        )
        assert sorted(patches.tolist()) == list(range(4 * step, 4 * step + 4))
    segments = torch.cat([p.tokens for p in plans if p.granularity == "segment"])
    assert sorted(segments.tolist()) == list(range(20))  # segment blocks still cover the stream
    params = resolve_method("mukv-middle").params
    assert params.views == "middle_frame" and params.rho == MuKVParams().rho
    with pytest.raises(UsageError, match=r"test.views: .nope. is not one of stream, middle_frame"):
        choose("mukv", views="nope")


def test_rerank_lifts_the_candidate_that_agrees_with_top_segments():
    segment = torch.tensor([[1.0, 0.0, 0.0]])
    agrees, disagrees = torch.tensor([0.9, 0.1, 0.0]), torch.tensor([0.0, 0.0, 1.0])
    reps = torch.stack([segment[0], agrees, disagrees])[:, None]  # one layer
    # the disagreeing patch scores a little higher on its own
    scores = torch.tensor([[0.5, 0.30, 0.32]])
    kinds = ["segment", "patch", "patch"]
    (picks,) = retrieve(scores, reps, kinds, {"patch": 1, "segment": 1}, {"patch": 0.3}, 5)
    patch = [i for i, g in zip(picks.index, picks.granularity) if g == "patch"]
    assert patch == [1]
    (without,) = retrieve(scores, reps, kinds, k={"patch": 1}, rerank={}, top_segments=5)
    assert without.index.tolist() == [2]
    # the block table hands granularities over as codes; the picks are the same
    (coded,) = retrieve(
        scores,
        reps,
        (torch.tensor([1, 0, 0]), ["patch", "segment"]),
        k={"patch": 1, "segment": 1},
        rerank={"patch": 0.3},
        top_segments=5,
    )
    assert coded.index.tolist() == picks.index.tolist()
    assert coded.granularity == picks.granularity and (coded.reranked == picks.reranked).all()


def test_every_layer_retrieved_at_once_picks_what_each_would_alone():
    """A pack retrieved layer by layer is scored for every layer in one batch: each layer's
    picks are those of the layer scored alone, its scores the same to float32's rounding."""
    g = torch.Generator().manual_seed(0)
    blocks, layers = 300, 6
    reps = torch.randn(blocks, layers, 32, generator=g).half()
    query = torch.randn(layers, 32, generator=g)
    codes = (torch.arange(blocks) % 3, ["segment", "frame", "patch"])
    k, rerank = {"frame": 20, "patch": 9, "segment": 4}, {"frame": 0.2, "patch": 0.3}
    for similarity in SIMILARITY.values():
        together = retrieve(similarity(query, reps.transpose(0, 1)), reps, codes, k, rerank, 3)
        for layer in range(layers):
            one = reps[:, layer : layer + 1]
            scores = similarity(query[layer : layer + 1], one.transpose(0, 1))
            (alone,) = retrieve(scores, one, codes, k, rerank, 3)
            assert together[layer].index.tolist() == alone.index.tolist()
            assert together[layer].granularity == alone.granularity
            assert np.allclose(together[layer].score, alone.score, rtol=1e-6, atol=1e-6)
            assert np.allclose(together[layer].reranked, alone.reranked, rtol=1e-6, atol=1e-6)
        assert len({tuple(p.index.tolist()) for p in together}) == layers  # each its own


def test_retrieval_picks_the_block_holding_a_planted_needle(tmp_path, backbones, clip):
    """Plant a needle: overwrite one block's representative with the question's own vector."""
    from mmkv_cli.ask.layerwise import question_vector
    from mmkv_cli.methods.rekv import ReKVParams, context
    from mmkv_cli.pack import write_pack

    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "r.kvpack"
    encode_pack(clip, pack, method="rekv-paper", backbone=backbone, max_frames=8)
    reader = PackReader(pack)
    question = "what color is the circle ?"
    ids = backbone.question_ids(question, reader.header.prompt.question)
    needle = question_vector(backbone, reader, ids, "query_mean")[-1:]  # the last layer's
    segments = [reader.span(b["name"]) for b in reader.blocks]
    for seg, meta in zip(segments, reader.blocks):
        seg.representative = reader.representatives()[reader.blocks.index(meta)]
    segments[5].representative = needle
    planted = tmp_path / "planted.kvpack"
    write_pack(planted, reader.header, reader.span("prefix"), segments, reader.span("suffix"))
    policy = context(ReKVParams(k=1, layers="last", similarity="cosine", retrieve="two_pass"))
    again = PackReader(planted)
    chosen = policy.select(
        again.blocks,
        again.representatives,
        lambda mode: question_vector(backbone, again, ids, mode),
    )
    assert chosen.names == [again.blocks[5]["name"]]
    # kept in a GPU pack's bf16, the index still finds it; asked before it, the rest compete
    as_bf16 = again.representatives().to(torch.bfloat16)
    vector = question_vector(backbone, again, ids, "query_mean")
    assert policy.select(again.blocks, lambda: as_bf16, lambda mode: vector).names == ["b5"]
    before = again.blocks[5]["time"][0] - 0.01
    earlier = policy.select(again.blocks, again.representatives, lambda mode: vector, at=before)
    assert len(earlier.names) == 1 and earlier.names != ["b5"]
    assert again.blocks[again.blocks.index_of(earlier.names[0])]["time"][0] <= before


@pytest.mark.parametrize("name", TINY)
def test_mukv_pack_counts_follow_rho_and_granularities(tmp_path, backbones, name, clip):
    backbone = backbones[name]
    pack = tmp_path / "mu.kvpack"
    encode_pack(clip, pack, method="mukv", backbone=backbone, max_frames=8)
    info = api.inspect(pack)
    reader = PackReader(pack)
    assert "segment" in info["granularities"]  # patch and frame blocks too where a grid allows
    assert set(info["granularities"]) <= {"patch", "frame", "segment"}
    layout = reader.header.layout
    lengths = reader.series("layout.step_lengths")
    per_step = layout.frames_per_step
    seg_steps = max(1, 4 // per_step)
    segments = [b for b in reader.blocks if b["granularity"] == "segment"]
    assert len(segments) == -(-len(lengths) // seg_steps)
    for block in segments:
        full = sum(lengths[block["steps"][0] : block["steps"][1]])
        assert block["layer_counts"] == [keep_count(full, 0.8)] * 4
    frames = [b for b in reader.blocks if b["granularity"] == "frame"]
    assert len(frames) == sum(keep_count(n, 0.1) > 0 for n in lengths)  # empty ones not stored
    for block in frames:
        assert block["layer_counts"][0] == keep_count(lengths[block["steps"][0]], 0.1)
    assert info["visual_kv_share"] <= 1.0  # the views together hold the budget, not more
    for g in info["granularities"].values():
        assert g["bytes"] > 0 and g["tokens"] > 0


@pytest.mark.parametrize("method", ["mukv", "mukv-middle", "rekv"])
def test_retrieval_methods_answer_in_a_new_process(tmp_path, backbones, clip, method):
    pack = tmp_path / f"{method}.kvpack"
    encode_pack(clip, pack, method=method, backbone=backbones["tiny-qwen2-vl"], max_frames=8)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmkv_cli",
            "ask",
            str(pack),
            "what happened first ?",
            "--json",
            "--explain",
            "--max-new-tokens",
            "2",
            "--positions",
            "reindex",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["retrieved"] and all(
        {"granularity", "time", "score", "reranked"} <= set(r) for r in result["retrieved"]
    )
    assert 0 < result["bytes_read"] <= PackReader(pack).size  # nothing is read twice


def test_question_moment_limits_retrieval_to_earlier_blocks(tmp_path, backbones, clip):
    pack = tmp_path / "mu.kvpack"
    encode_pack(clip, pack, method="mukv", backbone=backbones["tiny-llava-ov"], max_frames=8)
    answer = ask_pack(
        pack, "what happened first ?", backbone=backbones["tiny-llava-ov"], at=1.0, max_new_tokens=1
    )
    assert answer.retrieved and all(r["time"][0] <= 1.0 for r in answer.retrieved)


@pytest.mark.parametrize("name", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_reindex_with_every_block_equals_keep_when_nothing_was_dropped(
    tmp_path, backbones, name, clip
):
    """A full pack compacted and re-rotated gives the same first logits as kept positions (1-D
    exactly; on M-RoPE, whose video positions are already compact in time, reindex changes only
    gaps)."""
    backbone = backbones[name]
    pack = tmp_path / "full.kvpack"
    encode_pack(clip, pack, method="full", backbone=backbone, max_frames=4)
    keep = ask_pack(
        pack,
        "what color ?",
        backbone=backbone,
        keep_logits=True,
        max_new_tokens=1,
        positions="keep",
    )
    reindex = ask_pack(
        pack,
        "what color ?",
        backbone=backbone,
        keep_logits=True,
        max_new_tokens=1,
        positions="reindex",
    )
    assert (keep.first_logits - reindex.first_logits).abs().max().item() < 1e-4


def test_retrieval_needs_representatives_and_a_known_query_mode(tmp_path, backbones):
    from mmkv_cli.ask.answer import answer_from_pack
    from mmkv_cli.core.errors import PackError, UsageError
    from mmkv_cli.core.options import AskOptions
    from mmkv_cli.methods.retrieval import RetrievalContext, RetrievalOptions
    from mmkv_cli.pack import PackReader

    backbone = backbones["tiny-llava-ov"]
    options = RetrievalOptions(k={"frame": 64})
    # A hermes pack holds a summary block with no retrieval key: it stores no representatives at
    # all.
    encode_pack(
        "samples/clip.mp4",
        tmp_path / "h.kvpack",
        "tiny-llava-ov",
        "hermes",
        budget_tokens=40,
        backbone=backbone,
    )
    with pytest.raises(PackError, match="no block representatives"):
        answer_from_pack(
            backbone,
            PackReader(tmp_path / "h.kvpack"),
            RetrievalContext(options),
            "what ?",
            AskOptions(),
        )
    encode_pack(
        "samples/clip.mp4", tmp_path / "r.kvpack", "tiny-llava-ov", "rekv", backbone=backbone
    )
    with pytest.raises(UsageError, match="unknown query mode 'nope'"):
        answer_from_pack(
            backbone,
            PackReader(tmp_path / "r.kvpack"),
            RetrievalContext(replace(options, query="nope")),
            "what ?",
            AskOptions(),
        )


def test_rekv_encodes_through_a_sliding_window_and_still_stores_every_token(backbones, clip):
    from mmkv_cli.encode.encoder import encode_media
    from mmkv_cli.media import load_media

    backbone = backbones["tiny-llava-ov"]  # 16 tokens a frame
    media = load_media(clip, fps=8, max_frames=16)
    whole = encode_media(backbone, media, choose("rekv", window_tokens=None, chunk_frames=4))
    slid = encode_media(backbone, media, choose("rekv", window_tokens=64, chunk_frames=4))
    assert [b.layer_counts for b in slid.blocks] == [b.layer_counts for b in whole.blocks]
    assert all(count == [16] * 4 for count in (b.layer_counts for b in slid.blocks))
    for a, b in zip(whole.blocks, slid.blocks):
        assert torch.equal(a.keys[0], b.keys[0])  # layer 0 keys: token and position only
        assert torch.equal(a.positions[3], b.positions[3])
    # the first chunk saw the same context either way; the last one only its window
    assert torch.allclose(whole.blocks[0].values[3], slid.blocks[0].values[3], atol=1e-6)
    assert not torch.allclose(whole.blocks[-1].values[3], slid.blocks[-1].values[3], atol=1e-4)
    per_token = 2 * 2 * 16 * 4 * 4  # K and V, 2 KV heads, head dim 16, float32, 4 layers
    prompt = whole.prefix.layer_counts[0]
    assert (
        slid.stats["peak_kv_bytes"] <= (prompt + 64 + 64) * per_token < whole.stats["peak_kv_bytes"]
    )


def test_the_pack_takes_over_offloaded_entries_instead_of_copying_them():
    # An hour's offloaded KV is GBs on the host: making the pack's blocks hands the archive over
    # (in stream order, nothing dropped), so the host never holds it twice.
    from transformers import DynamicCache

    from mmkv_cli.methods.running_cache import RunningCache

    cache = DynamicCache()
    keys, values = torch.randn(1, 2, 2 + 6, 4), torch.randn(1, 2, 2 + 6, 4)
    for layer in range(2):
        cache.update(keys, values, layer)
    running = RunningCache(cache, prompt_len=2, position_dims=1)
    running.appended(torch.arange(6), torch.arange(2, 8).unsqueeze(0))
    for layer in range(2):
        running.offload(layer, 4)
    held = running.take_all_held()
    for k, v, positions, index in held:
        assert torch.equal(k, keys[0, :, 2:]) and torch.equal(v, values[0, :, 2:])
        assert index.tolist() == list(range(6)) and positions.tolist() == [list(range(2, 8))]
    assert len(running.archive[0]) == 0 and len(running.archive[1]) == 0  # handed over
    assert running.take_all_held()[0][3].tolist() == [4, 5]  # what is left in the window, once


def test_offloaded_entries_do_not_keep_the_cache_they_were_cut_from_alive():
    # On the CPU, slicing the oldest entries and calling .cpu() gives a view of the whole cache
    # tensor: every offload would then pin a window-sized tensor (ReKV at 512 frames grew the RSS
    # by 30 MB a chunk at one layer). The archive must hold exactly its own entries.
    from transformers import DynamicCache

    from mmkv_cli.methods.running_cache import RunningCache

    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 2 + 100, 4), torch.randn(1, 2, 2 + 100, 4), 0)
    running = RunningCache(cache, prompt_len=2, position_dims=3)
    running.appended(torch.arange(100), torch.arange(300).reshape(3, 100))
    running.offload(0, 10)
    for (held,) in running.archive[0].parts().values():  # its own slab, not the cache's storage
        assert (
            held.untyped_storage().data_ptr() != cache.layers[0].keys.untyped_storage().data_ptr()
        )
        assert held.shape[-1 if held.dim() < 3 else -2] == 10
    assert running.count(0) == 90


@pytest.mark.parametrize("name", ["tiny-llava-ov", "tiny-qwen2-vl"])
def test_mukv_compares_keys_after_rope_as_its_authors_code_does(tmp_path, backbones, clip, name):
    """question_answering: the question prefilled after the init prompt, its last token's
    last-layer key as it is (after RoPE) against each block's mean kept key as the block was
    prefilled; mukv-paper keeps both position-free."""
    from mmkv_cli.ask.layerwise import question_vector

    backbone = backbones[name]
    encode_pack(clip, tmp_path / "code.kvpack", method="mukv", backbone=backbone, max_frames=8)
    encode_pack(
        clip, tmp_path / "paper.kvpack", method="mukv-paper", backbone=backbone, max_frames=8
    )
    code, paper = PackReader(tmp_path / "code.kvpack"), PackReader(tmp_path / "paper.kvpack")
    assert code.rotated_representatives and not paper.rotated_representatives
    ids = backbone.question_ids("what color is the circle ?", code.header.prompt.question)
    prefix = code.span("prefix")
    cache = backbone.cache_from_layers(prefix.keys, prefix.values)
    with torch.inference_mode():
        placed = backbone.text_positions(prefix.layer_counts[0], len(ids))
        backbone.forward(backbone.embed_ids(ids), placed, cache)
    last_key = cache.layers[-1].keys[0, :, -1].reshape(-1).float().cpu()
    assert torch.allclose(question_vector(backbone, code, ids, "last_key")[-1], last_key, atol=1e-5)
    # the paper's reading rotates that key back to before RoPE: a different vector, same norm
    free = question_vector(backbone, paper, ids, "last_key")[-1]
    assert not torch.allclose(free, last_key, atol=1e-3)
    assert torch.linalg.vector_norm(free) == pytest.approx(
        float(torch.linalg.vector_norm(last_key)), rel=1e-4
    )


def test_a_retrieval_key_is_the_mean_key_after_rope_or_rotated_back_before_it():
    from mmkv_cli.kernels.rope import rotate_keys
    from mmkv_cli.methods.scoring import retrieval_key

    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    axes = torch.zeros(4, dtype=torch.long)  # 1-D RoPE: every frequency reads axis 0
    rope = (inv_freq, axes)
    free = torch.randn(2, 5, 8)  # [H_kv, n, D] before RoPE
    at = torch.tensor([[3, 4, 5, 9, 12]])
    rotated = rotate_keys(free, at, inv_freq, axes)
    post = retrieval_key([rotated], [at], rope, "post_rope")
    pre = retrieval_key([rotated], [at], rope, "pre_rope")
    assert torch.allclose(post, rotated.mean(dim=1).reshape(1, -1), atol=1e-6)
    assert torch.allclose(pre, free.mean(dim=1).reshape(1, -1), atol=1e-5)
    with pytest.raises(ValueError, match="space"):
        retrieval_key([rotated], [at], rope, "sideways")
