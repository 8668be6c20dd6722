"""STC: its pruner written out plainly in float64 from the definitions (the authors' STC_Pruner)
against mmkv's reducer, carried from chunk to chunk; its cacher's reusing layer written out against
mmkv's on a real SigLIP layer; a whole recompute equal to the plain tower; the same pack in any
chunking, live or not."""

import math

import pytest
import torch

from mmkv_cli.backbones import tower_reuse
from mmkv_cli.core.errors import UsageError
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext
from mmkv_cli.reduce import StepTokens, stc
from mmkv_cli.reduce.choice import check_reducer, resolve_reducer
from tests.conftest import SAMPLES
from tests.helpers import choose
from tests.test_live import assert_same_spans, cut


def plain_prune(frames, keep, share):
    """Per frame: the int(C x share) channels of least variance over its tokens; its mean joins
    the memory (the mean of every frame's mean so far); each token scored by the summed Gaussian
    kernels (widths 1/8 .. 2) to the frame's mean and to the memory, both of unit tokens; the
    `keep` lowest stay."""
    kept, means = [], []
    for x in frames:
        variance = [float(((x[:, c] - x[:, c].mean()) ** 2).mean()) for c in range(x.shape[1])]
        channels = sorted(range(x.shape[1]), key=lambda c: variance[c])[: int(x.shape[1] * share)]
        chosen = x[:, channels]
        means.append(chosen.mean(dim=0))
        memory = torch.stack(means).mean(dim=0)
        unit = chosen / chosen.norm(dim=1, keepdim=True)
        own = unit.mean(dim=0)
        remembered = memory / memory.norm()
        scores = []
        for token in unit:
            score = 0.0
            for width in (1 / 8, 1 / 4, 1 / 2, 1, 2):
                score += math.exp(-float(((token - own) ** 2).sum()) / (2 * width))
                score += math.exp(-float(((token - remembered) ** 2).sum()) / (2 * width))
            scores.append(score)
        kept.append(sorted(sorted(range(len(scores)), key=lambda t: scores[t])[:keep]))
    return kept


def test_the_pruner_is_the_definition_carried_across_chunks():
    torch.manual_seed(0)
    frames = torch.randn(6, 12, 10, dtype=torch.float64)
    params = stc.STCParams(retain=4 / 12)
    carried, got = {}, []
    for chunk in (frames[:2], frames[2:5], frames[5:]):  # chunks of any size: the same choice
        reduced = stc.reduce(params, StepTokens(chunk, None, None, carried))
        carried = reduced.carried
        got += [row.nonzero()[:, 0].tolist() for row in reduced.keep]
    assert got == plain_prune(frames, 4, 0.5)
    assert int(carried["memory_count"]) == 6


def plain_layer(layer, hidden, reference, share):
    """A reusing frame through a SigLIP layer, in float64: the share of tokens whose keys are least
    like the reference's recompute queries and values; they attend (softmax over q.k / sqrt(d),
    heads apart) to all current keys and to the reference's values but their own; the others take
    the reference's attention and MLP outputs."""
    attention = layer.self_attn
    ref_k, ref_v, ref_mixed, ref_mlp = (t.double() for t in reference)
    normed = layer.layer_norm1(hidden.float()).double()

    def proj(linear, x):
        return x @ linear.weight.double().T + linear.bias.double()

    keys = proj(attention.k_proj, normed)
    likeness = [float(keys[t] @ ref_k[t] / (keys[t].norm() * ref_k[t].norm())) for t in
                range(len(keys))]  # fmt: skip
    count = max(1, int(len(keys) * share))
    changed = sorted(range(len(keys)), key=lambda t: likeness[t])[:count]
    values = ref_v.clone()
    values[changed] = proj(attention.v_proj, normed[changed])
    queries = proj(attention.q_proj, normed[changed])
    heads, width = attention.num_heads, keys.shape[1] // attention.num_heads
    out = torch.zeros(len(changed), keys.shape[1], dtype=torch.float64)
    for h in range(heads):
        part = slice(h * width, (h + 1) * width)
        weights = torch.softmax(queries[:, part] @ keys[:, part].T / math.sqrt(width), dim=-1)
        out[:, part] = weights @ values[:, part]
    mixed = ref_mixed.clone()
    mixed[changed] = proj(attention.out_proj, out)
    after = hidden.double() + mixed
    mlp = ref_mlp.clone()
    mlp[changed] = layer.mlp(layer.layer_norm2(after.float())[changed]).double()
    return after + mlp


def test_a_reusing_frame_is_the_definition(backbones):
    layer = backbones["tiny-llava-ov"].model.model.vision_tower.encoder.layers[0].float()
    torch.manual_seed(1)
    first, second = torch.randn(2, 16, layer.self_attn.embed_dim)
    with torch.no_grad():
        out, reference = tower_reuse.whole_frame(layer, first)
        assert torch.allclose(out, layer(first[None], None)[0], atol=1e-5)  # a whole frame
        ours = tower_reuse.reusing_frame(layer, second, reference, 0.25)
        want = plain_layer(layer, second, reference, 0.25)
        assert torch.allclose(ours.double(), want, atol=1e-4)
        every = tower_reuse.reusing_frame(layer, second, reference, 1.0)
        assert torch.allclose(every, layer(second[None], None)[0], atol=1e-5)  # all recomputed


def test_recomputing_every_token_is_the_plain_tower_and_the_pack_is_the_same_in_any_chunks(
    backbones,
):
    backbone = backbones["tiny-llava-ov"]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=12)
    whole = choose("full", chunk_frames=4).with_reduce("stc", {"update_share": 1.0})
    plain = choose("full", chunk_frames=4).with_reduce("stc", {"reuse_every": 1})
    assert_same_spans(encode_media(backbone, media, whole), encode_media(backbone, media, plain))
    reusing = choose("full", chunk_frames=4).with_reduce("stc")
    other = choose("full", chunk_frames=3).with_reduce("stc")  # chunks from odd frames
    a, b = encode_media(backbone, media, reusing), encode_media(backbone, media, other)
    assert_same_spans(a, b)
    assert not torch.allclose(a.blocks[1].keys[0], encode_media(backbone, media, plain)
                              .blocks[1].keys[0])  # fmt: skip  # the second frame reused


def test_stc_holds_live_what_the_cut_media_holds(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=12)
    choice = choose("full", chunk_frames=4).with_reduce("stc")
    live = LiveEncoder(backbone, choice, EncodeContext("video"))
    frames = media.read(0, media.num_frames)
    for i, at in enumerate(media.timestamps):
        live.push(frames[i], at)
        if i + 1 in (5, 8):
            want = encode_media(backbone, cut(media, i + 1), choice, EncodeContext("video"),
                                clip_frames=backbone.spec.max_frames)  # fmt: skip
            assert_same_spans(live.memory(), want)


def test_reuse_is_refused_where_the_adapter_has_none():
    with pytest.raises(UsageError, match="reuse_every: 1"):
        check_reducer(resolve_reducer("stc"), "video", "qwen3_vl", [], ["llava_onevision"])
    check_reducer(resolve_reducer("stc", {"reuse_every": 1}), "video", "qwen3_vl", [], [])
    with pytest.raises(UsageError, match="takes video"):
        check_reducer(resolve_reducer("stc"), "pdf", None, [], [])
