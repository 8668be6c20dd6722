"""ReKV's retrieval inside the answering forward (its authors' code): layer l chooses its blocks
with the question's query at layer l, after the layers below attended what they chose. The reference
here is written from that definition with the two-pass machinery: one forward per layer, each with
the choices of the layers below fixed, then the answering forward over every layer's choice."""

import pytest
import torch

from mmkv_cli.api import context_policy
from mmkv_cli.ask.answer import build_cache
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import MethodSpec
from mmkv_cli.kernels.attention import Recorder, recording
from mmkv_cli.kernels.rope import unrotate
from mmkv_cli.pack import PackReader
from tests.helpers import ask_pack, choose, encode_pack

QUESTION = "what color is the circle ?"


def rekv_pack(tmp_path, backbone, clip):
    """ReKV's pack of 8 frames, 3 blocks retrieved a layer."""
    pack = tmp_path / "r.kvpack"
    encode_pack(clip, pack, method=MethodSpec("rekv", {"k": 3}), backbone=backbone,
                max_frames=8)  # fmt: skip
    return pack


def reference_choice(backbone, reader, ids, k, mode="keep"):
    """Every layer's blocks (table rows, time order) as ReKV's code picks them, and the first
    token's logits over them. positions reindex: every layer's context compacted, the question
    right after (one place for all layers: here every block is a frame of the same size)."""
    reps = reader.representatives().float()  # [blocks, layers, H_kv * D]
    layers = reps.shape[1]
    inv_freq, axes = backbone.rope_tables()
    chosen: list[list[str]] = [[] for _ in range(layers)]

    def forward(record: Recorder | None):
        union = sorted({n for names in chosen for n in names}, key=reader.blocks.index_of)
        cache, _, start, *_ = build_cache(backbone, reader, union, mode, per_layer=chosen)
        at = backbone.text_positions(start, len(ids))
        with recording(record or Recorder(layers=set())):
            hidden = backbone.forward(backbone.embed_ids(ids), at, cache)
        return at, backbone.logits(hidden[:, -1])[0]

    for layer in range(layers):
        record = Recorder(layers={layer}, queries=True)
        positions, _ = forward(record)
        query = unrotate(record.query[layer][0].float(), positions, inv_freq, axes)  # [H, n, D]
        kv_heads = reader.span("prefix").keys[layer].shape[0]
        per_head = query.mean(dim=1)  # over the question's tokens
        vector = per_head.reshape(kv_heads, -1, per_head.shape[-1]).mean(dim=1).reshape(-1)
        scores = reps[:, layer] @ vector  # the code's raw dot product
        rows = sorted(torch.topk(scores, k).indices.tolist())
        chosen[layer] = [reader.blocks.name(r) for r in rows]
    return chosen, forward(None)[1]


@pytest.mark.parametrize("positions", ["keep", "reindex"])
def test_each_layer_retrieves_with_its_own_query_inside_the_forward(
    tmp_path, backbones, clip, positions
):
    backbone = backbones["tiny-llava-ov"]
    pack = rekv_pack(tmp_path, backbone, clip)
    reader = PackReader(pack)
    ids = backbone.question_ids(QUESTION, reader.header.prompt.question)
    wanted, logits = reference_choice(backbone, reader, ids, 3, positions)

    answer = ask_pack(
        pack, QUESTION, backbone=backbone, max_new_tokens=1, keep_logits=True, positions=positions
    )
    assert all(entry["layers"] >= 1 for entry in answer.retrieved)
    # the layers' choosing and reading are their own phases, taken out of the prefill's
    phases = answer.phases_s
    assert phases["read"] > 0 and phases["select"] > 0 and phases["prefill"] > 0
    assert sum(phases.values()) == pytest.approx(answer.ttft_s, rel=1e-6)
    union = {n for names in wanted for n in names}
    assert set(answer.blocks_used) == union
    assert [e["block"] for e in answer.retrieved] == sorted(union, key=reader.blocks.index_of)
    torch.testing.assert_close(answer.first_logits, logits.cpu(), rtol=1e-4, atol=1e-4)
    # the picks layer by layer, through the selection the forward left behind
    policy = context_policy(reader)
    selection = policy.select(reader.blocks, reader.representatives, None)
    by_layer = _run_in_forward(backbone, reader, selection, ids)
    assert by_layer == wanted
    # the layers disagree somewhere, or this test could not tell per-layer choice from one choice
    assert len({tuple(names) for names in wanted}) > 1


def _run_in_forward(backbone, reader, selection, ids):
    from mmkv_cli.ask.layerwise import in_forward_splice
    from mmkv_cli.kernels.attention import splicing

    cache, _, start, *_ = build_cache(backbone, reader, [])
    positions = backbone.text_positions(start, len(ids))
    splice = in_forward_splice(backbone, reader, selection.in_forward, cache, positions, len(ids))
    with splicing(splice):
        backbone.forward(backbone.embed_ids(ids), positions, cache)
    return selection.in_forward.selection().per_layer


def test_layer_zero_chooses_as_the_two_pass_reading_does(tmp_path, backbones, clip):
    """Layer 0's query has seen no video in either reading: its blocks are the same."""
    backbone = backbones["tiny-qwen2-vl"]
    made = {}
    for mode in ("in_forward", "two_pass"):
        made[mode] = tmp_path / f"{mode}.kvpack"
        spec = MethodSpec("rekv", {"k": 2, "retrieve": mode})
        encode_pack(clip, made[mode], method=spec, backbone=backbone, max_frames=8)
    answers = {
        mode: ask_pack(pack, QUESTION, backbone=backbone, max_new_tokens=1)
        for mode, pack in made.items()
    }
    reader = PackReader(made["in_forward"])
    ids = backbone.question_ids(QUESTION, reader.header.prompt.question)
    both = []
    for pack in made.values():
        reader = PackReader(pack)
        selection = context_policy(reader).select(
            reader.blocks, reader.representatives, _two_pass_vector(backbone, reader, ids)
        )
        if selection.in_forward is not None:
            both.append(_run_in_forward(backbone, reader, selection, ids))
        else:
            both.append(selection.per_layer)
    assert both[0][0] == both[1][0]
    assert all(len(names) == 2 for names in both[0])
    assert answers["in_forward"].blocks_used  # the answer names what the layers retrieved


def _two_pass_vector(backbone, reader, ids):
    from mmkv_cli.ask.layerwise import question_vector

    return lambda mode: question_vector(backbone, reader, ids, mode)


def test_in_forward_retrieval_refuses_what_it_cannot_do(tmp_path, backbones, clip):
    with pytest.raises(UsageError, match="retrieve: in_forward needs layers: each"):
        choose("rekv", layers="last")
    choose("rekv", layers="last", retrieve="two_pass")  # the paper's reading, as rekv-paper sets
    from mmkv_cli.core.errors import PackError
    from mmkv_cli.methods.rekv import ReKVParams, context

    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "r.kvpack"  # one retrieval key a block: cannot retrieve layer by layer
    encode_pack(clip, pack, method="rekv-paper", backbone=backbone, max_frames=4)
    reader = PackReader(pack)
    selection = context(ReKVParams(k=1)).select(reader.blocks, reader.representatives, None)
    with pytest.raises(PackError, match="layers: each"):
        _run_in_forward(backbone, reader, selection, [1, 2, 3])


def test_a_live_moment_retrieves_in_the_forward_from_what_was_shown(tmp_path, backbones, clip):
    """Asked at a moment, the stored suffix is re-run with the question; each layer still picks
    only blocks shown by then, and the question's rows alone ask."""
    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "r.kvpack"
    encode_pack(clip, pack, method=MethodSpec("rekv", {"k": 2}), backbone=backbone,
                max_frames=8)  # fmt: skip
    reader = PackReader(pack)
    times = reader.blocks.times()
    moment = float(times[4][1])
    answer = ask_pack(pack, QUESTION, backbone=backbone, max_new_tokens=1, at=moment)
    shown = {reader.blocks.name(i) for i in range(5)}
    assert answer.blocks_used and set(answer.blocks_used) <= shown


def test_a_preset_asking_in_forward_retrieval_of_the_last_layer_is_refused_in_one_line(tmp_path):
    from tests.conftest import SAMPLES
    from tests.helpers import run_mmkv

    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "rekv-last.yaml").write_text("extends: rekv\nparams:\n  layers: last\n")
    clip, out = str(SAMPLES / "clip.mp4"), str(tmp_path / "p.kvpack")
    done = run_mmkv("--presets", str(tmp_path), "encode", clip, "--model", "demo",
                    "--method", "rekv-last", "-o", out)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "retrieve: in_forward needs layers: each" in done.stderr
    assert not (tmp_path / "p.kvpack").exists()


def test_layers_read_while_the_layers_before_are_still_hashed_answer_the_same(
    tmp_path, backbones, clip, monkeypatch
):
    """Each layer's rows handed over before their checksums are done (as a 7B layer's are) give
    the same first logits as rows checked first."""
    from tests.test_layer_digests import deferring

    backbone = backbones["tiny-llava-ov"]
    pack = rekv_pack(tmp_path, backbone, clip)
    checked = ask_pack(pack, QUESTION, backbone=backbone, max_new_tokens=1, keep_logits=True)
    left = deferring(monkeypatch)
    deferred = ask_pack(pack, QUESTION, backbone=backbone, max_new_tokens=1, keep_logits=True)
    assert len(left) >= 2  # the layers' reads at least
    assert deferred.answer == checked.answer
    torch.testing.assert_close(deferred.first_logits, checked.first_logits, rtol=0, atol=0)


def test_a_flipped_layer_read_inside_the_forward_is_refused_before_any_token(
    tmp_path, backbones, clip, monkeypatch
):
    from mmkv_cli import api
    from mmkv_cli.core.errors import PackError
    from mmkv_cli.core.options import AskOptions, GenerationOptions
    from tests.mutants import Parts
    from tests.test_layer_digests import deferring

    backbone = backbones["tiny-llava-ov"]
    pack = rekv_pack(tmp_path, backbone, clip)
    parts = Parts.of(pack.read_bytes())
    start, stop = parts.directory["blocks.k"]["data_offsets"]
    for at in range(start, stop, 16):  # every block's every layer: whichever a layer picks
        parts.data[at] ^= 0x20
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    left = deferring(monkeypatch)
    shown: list[str] = []
    asking = AskOptions(generation=GenerationOptions(8))
    with pytest.raises(PackError, match="checksum mismatch"):
        api.ask(bad, QUESTION, asking, backbone=backbone, on_token=shown.append)
    assert left and shown == []
