"""Per-head memory (issue 51): each (layer, KV head) keeps tokens of its own. The references are
written from the definitions: a head's attention over its own entries alone, each KV head's column
sums by explicit softmax, MEDA's merge one head at a time, AdaKV's budgets by sorting, and a
per-head pack answered as the union of its heads' tokens with each head masked to its own."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import mmkv
from mmkv_cli.ask.heads import join_heads
from mmkv_cli.core.options import MethodSpec
from mmkv_cli.kernels import fused_attention as fused
from mmkv_cli.kernels.attention import Recorder, masking, with_heads
from mmkv_cli.kernels.scores import _blockwise_recorded
from mmkv_cli.methods.meda import merge_evicted
from mmkv_cli.methods.scoring import adaptive_per_head, top_per_head
from mmkv_cli.pack import FORMAT_VERSION, PackReader
from mmkv_cli.pack.access.report import inspect
from mmkv_cli.pack.access.writer import write_pack
from tests.helpers import ask_pack, encode_pack

QUESTION = "what color is the circle ?"


@pytest.fixture(scope="module")
def demo():
    """The trained demo backbone: its heads attend differently (a tiny random model's all agree)."""
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    return load_backbone(LoadOptions("demo", "cpu"))


def names(reader) -> list[str]:
    return [reader.blocks.name(i) for i in range(len(reader.blocks))]


def each_head_alone(query, own, own_v, new_k, new_v, group):
    """Every query head's causal attention over its KV head's own entries and the forward's."""
    dim, q_len = query.shape[-1], query.shape[2]
    out = []
    for head in range(query.shape[1]):
        kv = head // group
        k = torch.cat([own[kv][0], new_k[kv]])
        v = torch.cat([own_v[kv][0], new_v[kv]])
        scores = query[0, head] @ k.T / dim**0.5
        seen = torch.ones(q_len, k.shape[0], dtype=torch.bool).tril(k.shape[0] - q_len)
        out.append(scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v)
    return torch.stack(out)


@pytest.mark.parametrize("q_len", [3, 1])  # a question's rows; a decoded token
def test_a_head_attends_only_to_its_own_entries(monkeypatch, q_len):
    """Both ways a cache held per head is attended: a mask over any layout (the encode's running
    cache, entries interleaved), and each head's own slice of a row padded before it (ask)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmkv_cli.kernels import attention

    torch.manual_seed(0)
    dim, group = 8, 2
    lengths = (5, 2, 2)  # three KV heads: the last two start together
    own = [torch.randn(1, n, dim) for n in lengths]
    own_v = [torch.randn(1, n, dim) for n in lengths]
    new_k, new_v = torch.randn(3, q_len, dim), torch.randn(3, q_len, dim)  # the forward's own
    query = torch.randn(1, 3 * group, q_len, dim)
    want = each_head_alone(query, own, own_v, new_k, new_v, group)
    module = SimpleNamespace(num_key_value_groups=group, is_causal=True)
    monkeypatch.setattr(attention, "_sdpa", sdpa_attention_forward)

    # padded before each head's own: its slice of the row
    keys, values, starts = join_heads([[k] for k in own], [[v] for v in own_v], 3)
    assert starts == {0: (0, 3, 3)}
    key = torch.cat([keys[0], new_k], dim=1)[None]
    value = torch.cat([values[0], new_v], dim=1)[None]
    got, _ = attention.head_slices(module, query, key, value, starts[0])
    torch.testing.assert_close(got[0].transpose(0, 1), want, atol=1e-5, rtol=1e-5)

    # interleaved, as the running cache holds a layer: the union, each head masked to its own
    held = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 1]], dtype=bool)
    union_k, union_v = torch.zeros(3, 6, dim), torch.zeros(3, 6, dim)
    for head in range(3):
        union_k[head, held[head]] = own[head][0]
        union_v[head, held[head]] = own_v[head][0]
    key = torch.cat([union_k, new_k], dim=1)[None]
    value = torch.cat([union_v, new_v], dim=1)[None]
    mask = with_heads(query, key, attention.own_length_mask(query, key, None), held)
    got, _ = sdpa_attention_forward(module, query, key, value, mask)
    torch.testing.assert_close(got[0].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def reference_head_sums(query, key, scaling):
    """Each KV head's column sums: explicit causal softmax per query head, the mean over a KV
    head's query heads, summed over rows."""
    heads, kv_heads = query.shape[1], key.shape[1]
    k = key.repeat_interleave(heads // kv_heads, 1)
    scores = query @ k.transpose(-1, -2) * scaling
    q_len, k_len = query.shape[2], key.shape[2]
    seen = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return probs.reshape(1, kv_heads, -1, q_len, k_len).mean(2).sum(2)


def test_column_sums_per_kv_head_on_both_paths():
    torch.manual_seed(1)
    query, key, value = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 15, 8), torch.randn(1, 2, 15, 8)
    scaling = 8**-0.5
    want = reference_head_sums(query, key, scaling)
    _, lse = fused.lse_attention(query, key, value, scaling)
    got = fused.column_sums(query, key, lse, scaling, per_head=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.column_sums(query, key, lse, scaling), want.mean(1))
    recorder = Recorder(layers={0}, column_sums=True, per_head=True)
    _blockwise_recorded(recorder, 0, query, key, value, scaling)
    torch.testing.assert_close(recorder.column_sum[0], want, atol=1e-5, rtol=1e-5)


def test_adakv_budgets_give_a_spread_heads_share_to_the_best_scores_over_all_heads():
    scores = torch.tensor(
        [[9.0, 0.5, 0.4, 0.3, 0.2, 0.1], [1.0, 1.2, 1.1, 1.3, 0.9, 1.4]]
    )  # head 0 concentrated on one token, head 1 spread
    picks = adaptive_per_head(scores, 3, floor=1 / 3)
    # each head its own best first (one each), then the best four left over both heads
    assert [p.tolist() for p in picks] == [[0], [0, 1, 2, 3, 5]]
    assert sum(len(p) for p in picks) == 2 * 3
    equal = top_per_head(scores, 3)
    assert [p.tolist() for p in equal] == [[0, 1, 2], [1, 3, 5]]
    whole = adaptive_per_head(scores, 3, floor=1.0)  # the floor is the whole budget: equal
    assert [p.tolist() for p in whole] == [p.tolist() for p in equal]


@pytest.mark.parametrize("form", ["pivot", "mean"])
def test_meda_merges_each_head_into_its_own_kept_tokens(form):
    torch.manual_seed(2)
    keys, values = torch.randn(3, 12, 8), torch.randn(3, 12, 8)
    kept = torch.stack([torch.randperm(12)[:5].sort().values for _ in range(3)])
    k, v, target = merge_evicted(keys, values, kept, form=form)
    for head in range(3):
        one = merge_evicted(keys[head : head + 1], values[head : head + 1], kept[head], form=form)
        torch.testing.assert_close(k[head], one[0][0])
        torch.testing.assert_close(v[head], one[1][0])
        assert torch.equal(target[head], one[2][0])


def union_reference(backbone, reader, ids):
    """The first token's logits from a per-head pack, built otherwise than ask builds it: per layer
    the union of its heads' tokens in position order (1-D positions name a token), each head's own
    K/V where it holds the token, masked where it does not; the question at the stored next
    position, and three greedy tokens decoded after it. A token is named by its positions (every
    axis)."""
    heads = reader.header.kv.kv_heads
    spans = [reader.span("prefix"), *(reader.span(n) for n in names(reader)),
             reader.span("suffix")]  # fmt: skip
    keys, values, masks = [], [], {}
    for layer in range(reader.header.kv.layers):
        rows = [layer * heads + h for h in range(heads)]
        held = [
            {
                tuple(p): (s.keys[r][0, i], s.values[r][0, i])
                for s in spans
                for i, p in enumerate(s.positions[r].T.tolist())
            }  # fmt: skip
            for r in rows
        ]
        union = sorted(set().union(*held))
        zero = torch.zeros_like(next(iter(held[0].values()))[0])
        for part, out in enumerate((keys, values)):
            rows = [[h.get(p, (zero, zero))[part] for p in union] for h in held]
            out.append(torch.stack([torch.stack(row) for row in rows]))
        masks[layer] = torch.tensor([[p in h for p in union] for h in held])
    cache = backbone.cache_from_layers(keys, values)
    position = int(reader.header.layout.next_position)
    at = backbone.text_positions(position, len(ids))
    tokens = []
    with masking(masks):  # the question, then three greedy tokens (entries appended: every head's)
        hidden = backbone.forward(backbone.embed_ids(ids), at, cache)
        first = logits = backbone.logits(hidden[:, -1])[0]
        position += len(ids)
        for _ in range(3):
            tokens.append(int(logits.argmax()))
            hidden = backbone.forward(
                backbone.embed_ids(tokens[-1:]), backbone.text_positions(position, 1), cache
            )
            logits, position = backbone.logits(hidden[:, -1])[0], position + 1
    return first, masks, tokens


@pytest.mark.parametrize("method", ["h2o", "h2o-adaptive", "meda", "snapkv", "pyramidkv"])
def test_a_per_head_pack_answers_as_each_head_over_its_own_tokens(tmp_path, demo, clip, method):
    backbone = demo
    spec = MethodSpec("h2o", {"head_budgets": "adaptive"}) if method == "h2o-adaptive" else method
    pack = tmp_path / "h.kvpack"
    encode_pack(clip, pack, method=spec, budget=0.25, backbone=backbone, max_frames=8)
    reader = PackReader(pack)
    assert reader.header.kv.per_head and reader.format_version == FORMAT_VERSION
    ids = backbone.question_ids(QUESTION, reader.header.prompt.question)
    want, masks, tokens = union_reference(backbone, reader, ids)
    differ = [bool((m != m[:1]).any()) for m in masks.values()]
    assert any(differ)  # the heads keep different tokens
    got = ask_pack(pack, QUESTION, backbone=backbone, keep_logits=True, max_new_tokens=3)
    torch.testing.assert_close(got.first_logits, want.float(), atol=1e-4, rtol=1e-4)
    assert got.token_ids == tokens[: len(got.token_ids)] and got.token_ids  # decoding too
    info = inspect(pack)
    assert mmkv.inspect(pack).per_head and info["per_head"]  # the Python face says so too
    for layer in info["layers"]:
        heads = layer["heads"]
        assert layer["tokens_kept"] == pytest.approx(sum(heads) / len(heads), abs=0.01)
        if method != "h2o-adaptive":
            assert len(set(heads)) == 1  # equal budgets: every head the layer's
    if method == "h2o-adaptive":
        assert any(len(set(layer["heads"])) > 1 for layer in info["layers"])


def test_h2o_heads_keep_their_own_heaviest_and_per_layer_keeps_the_heads_mean(
    tmp_path, demo, clip, monkeypatch
):
    """Each head's kept tokens are the top of its own accumulated attention; the per-layer reading
    keeps the top of the heads' mean of the same sums (the recorder's per-head sums, averaged, are
    its per-layer sums: test_column_sums_per_kv_head_on_both_paths)."""
    from mmkv_cli.methods import h2o

    backbone = demo
    seen = {}
    original = h2o.H2OMemory.layer_scores

    def keep_scores(self, state):
        scores = original(self, state)
        seen[self.params.selection] = (scores, [p.clone() for p in state.cache.positions])
        return scores

    monkeypatch.setattr(h2o.H2OMemory, "layer_scores", keep_scores)
    packs = {}
    for selection in ("per_head", "per_layer"):
        packs[selection] = tmp_path / f"{selection}.kvpack"
        spec = MethodSpec("h2o", {"selection": selection})
        encode_pack(clip, packs[selection], method=spec, budget=0.25, backbone=backbone,
                    max_frames=8)  # fmt: skip
    scores, positions = seen["per_head"]
    reader = PackReader(packs["per_head"])
    heads, keep = reader.header.kv.kv_heads, None
    for layer, layer_scores in enumerate(scores):
        assert layer_scores.shape[0] == heads
        for head in range(heads):
            stored = torch.cat(
                [reader.span(n).positions[layer * heads + head] for n in names(reader)], dim=1
            )
            keep = keep or stored.shape[1]
            want = positions[layer][:, top_per_head(layer_scores, keep)[head]]
            assert torch.equal(stored, want)  # in time order, as the blocks hold them
    mean_scores, mean_positions = seen["per_layer"]
    per_layer = PackReader(packs["per_layer"])
    assert not per_layer.header.kv.per_head
    for layer, layer_scores in enumerate(mean_scores):
        torch.testing.assert_close(layer_scores, scores[layer].mean(0), atol=1e-5, rtol=1e-4)
        stored = torch.cat([per_layer.span(n).positions[layer] for n in names(per_layer)], dim=1)
        want = mean_positions[layer][:, layer_scores.topk(keep).indices.sort().values]
        assert torch.equal(stored, want)


@pytest.mark.parametrize("positions", ["keep", "reindex"])
def test_a_per_head_pack_whose_heads_agree_is_the_per_layer_pack(tmp_path, backbones, clip,
                                                                 positions):  # fmt: skip
    """A per-layer pack is the per-head pack whose heads agree: stored head by head, it answers
    the same, in both position modes."""
    backbone = backbones["tiny-qwen2.5-vl"]
    source = tmp_path / "l.kvpack"
    encode_pack(clip, source, method="snapkv", budget=0.25, backbone=backbone, max_frames=8)
    reader = PackReader(source)
    header = reader.header
    split = tmp_path / "split.kvpack"
    blocks = [reader.span(n).by_head() for n in names(reader)]
    write_pack(
        split,
        replace(header, kv=replace(header.kv, per_head=True)),
        reader.span("prefix").by_head(),
        blocks,
        reader.span("suffix").by_head(),
    )
    assert PackReader(split).header.kv.per_head
    a = ask_pack(source, QUESTION, backbone=backbone, keep_logits=True, max_new_tokens=3,
                 positions=positions)  # fmt: skip
    b = ask_pack(split, QUESTION, backbone=backbone, keep_logits=True, max_new_tokens=3,
                 positions=positions)  # fmt: skip
    torch.testing.assert_close(a.first_logits, b.first_logits, atol=1e-5, rtol=1e-5)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(
    "forge",
    [
        ("per_head", True, 10),  # a v10 pack cannot be held per head
        ("per_head", "yes", 11),
        ("per_head", False, 11),  # the spans still hold a layer of one head a head
        ("layers", 600, 11),  # 600 x 2 heads: more stored layers than any model has
    ],
)
def test_a_forged_per_head_header_is_refused_in_one_line(tmp_path, forge):
    from mmkv_cli.core.errors import PackError
    from tests.mutants import Parts

    field, value, version = forge
    golden = PackReader(Path(__file__).parent / "data" / "golden" / "h2o-demo.kvpack")
    assert golden.header.kv.per_head
    parts = Parts.of(Path(golden.path).read_bytes())
    header = parts.header()
    header["kv"][field] = value
    header["format_version"] = version
    parts.set_header(header)
    parts.reseal()
    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="is corrupted") as err:
        PackReader(forged)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("method", ["h2o", "meda"])
def test_a_live_memory_held_per_head_is_the_cut_medias_and_answers_in_place(tmp_path, demo, method):
    """Live, a memory held per head at moment T is the pack of the media cut at T (test_live), and
    asking it in place, with and without a moment, is asking that pack (test_live_memory)."""
    from tests.test_live import assert_same_spans, follow
    from tests.test_live_memory import test_a_question_of_the_memory_in_place_is_the_written_packs

    layers, heads = demo.kv_shape()["layers"], demo.kv_shape()["kv_heads"]
    held = []
    for got, want in follow(demo, method, (6, 13)):
        assert len(got.prefix.keys) == len(got.blocks[0].keys) == len(got.suffix.keys)
        held.append(len(got.prefix.keys) == layers * heads)
        assert_same_spans(got, want)
    assert held == [False, True, True]  # 6 frames fit the budget; then each head keeps its own
    test_a_question_of_the_memory_in_place_is_the_written_packs(tmp_path, {"demo": demo}, "demo",
                                                                method)  # fmt: skip


def test_pruning_a_pack_held_per_head_is_refused_in_one_line():
    from tests.helpers import run_mmkv

    golden = Path(__file__).parent / "data" / "golden" / "h2o-demo.kvpack"
    done = run_mmkv("ask", str(golden), QUESTION, "--prune", "snapkv", "--max-new-tokens", "1")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "is held per head: --prune is for packs held per layer" in lines[0]
