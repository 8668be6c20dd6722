"""SAVEMem's retrieval at the question (issue 73): the late interaction and how many frames stay,
written out plainly against mmkv's functions; the pack keeps the kept tokens as the language model
took them in (format v13), every byte under its digests at a real model's width; a question drops
the frames it matches least, live as from the written pack; a pack that keeps none (v12) gives the
whole memory."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mmkv_cli import api
from mmkv_cli.api import PackSession
from mmkv_cli.core.errors import PackError
from mmkv_cli.core.options import AskOptions, GenerationOptions
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.encode.record import pack_header, write_encoded
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from mmkv_cli.methods import EncodeContext, savemem
from mmkv_cli.methods.savemem_retrieval import frames_kept, late_interaction
from mmkv_cli.pack import PackReader, QuantSpec, block_name, write_pack
from mmkv_cli.pack.access.memory import MemoryPack
from tests.conftest import SAMPLES
from tests.helpers import ask_pack, choose, watched, with_policy
from tests.mutants import Parts
from tests.test_pack_versions import HEADER, fixture_segment

DATA = Path(__file__).parent / "data"
Watched = watched(savemem.SaveMemMemory)
MODEL = "tiny-llava-ov"  # one frame a step
QUESTION = "what color is the circle ?"


def plain_scores(tokens, question, frames):
    """Each frame's (its tokens' rows of `tokens`) mean over its visual tokens (a marker's row is
    zero) of the best dot product with any question token, in float64; 0 with none."""
    out = []
    for rows in frames:
        seen = [t for t in rows if tokens[t].abs().sum() > 0]
        best = [max(float(tokens[t].double() @ q.double()) for q in question) for t in seen]
        out.append(sum(best) / len(best) if best else 0.0)
    return out


def plain_kept(scores: list[float], top_k: int) -> int:
    """How many frames stay: all where the scores' coefficient of variation (sample deviation
    over the mean's size) is at most 0.05, top_k where it is 0.3 or more, on the line between
    else; never fewer than the larger of top_k and 90% of them (rounded down)."""
    n = len(scores)
    if n <= top_k:
        return n
    cv = statistics.stdev(scores) / max(abs(statistics.fmean(scores)), 1e-8)
    if cv <= 0.05:
        kept = n
    elif cv >= 0.3:
        kept = top_k
    else:
        kept = int(n - (cv - 0.05) / 0.25 * (n - top_k))
    return max(kept, min(max(top_k, int(0.9 * n)), n))


@pytest.mark.parametrize("seed", range(4))
def test_the_late_interaction_is_the_definition(seed):
    gen = torch.Generator().manual_seed(seed)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    tokens, question = (
        unit(torch.randn(23, 16, generator=gen)),
        unit(torch.randn(5, 16, generator=gen)),
    )
    tokens[[0, 4, 11, 12]] = 0.0  # markers (Qwen3-VL's): the second frame has no visual token
    sizes = [4, 1, 7, 5, 6]
    frame_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    frames = [frame_of.eq(f).nonzero()[:, 0].tolist() for f in range(len(sizes))]
    scores, visual = late_interaction(tokens, question, frame_of, len(sizes))
    assert scores.tolist() == pytest.approx(plain_scores(tokens, question, frames), abs=1e-6)
    assert visual.tolist() == [3, 0, 6, 4, 6]


@pytest.mark.parametrize(
    ("spread", "count", "top_k"),
    [(0.0, 30, 10), (0.01, 30, 10), (0.1, 30, 25), (0.2, 40, 2), (0.6, 30, 10), (0.6, 5, 10)],
)
def test_how_many_frames_stay_is_the_definition(spread, count, top_k):
    rng = random.Random(count * 7 + top_k)
    scores = torch.tensor([0.4 + spread * 0.4 * rng.gauss(0, 1) for _ in range(count)])
    want = plain_kept([float(s) for s in scores], top_k)
    assert frames_kept(scores, top_k) == want
    if spread == 0.0 or count <= top_k:
        assert want == count  # alike, or few: every frame stays
    if spread >= 0.2 and count > top_k:
        assert want == max(top_k, int(0.9 * count)) < count  # apart: the floor holds


def retrieving(**params):
    return choose("savemem", **{"short_term_frames": 2, "mid_term_frames": 2, "retrieval_top_k": 1,
                                **params})  # fmt: skip


def media_of(frames: int = 16):
    return load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=frames)


def test_each_block_keeps_its_tokens_as_taken_in(backbones):
    choice = retrieving()
    memory = Watched(choice.params, choice.budget, EncodeContext("video"))
    encoded = encode_media(backbones[MODEL], media_of(), with_policy(choice, memory))
    taken_in = {int(i): x for index, grid in memory.frames for i, x in zip(index, grid)}
    counts = [block.layer_counts[0] for block in encoded.blocks]
    assert sum(counts) == len(memory.kept) and len(encoded.blocks) > 4
    for block, held in zip(encoded.blocks, np.split(memory.kept, np.cumsum(counts)[:-1])):
        assert block.embeddings.dtype == torch.float16
        want = torch.stack([taken_in[int(i)] for i in held])
        want = want / want.norm(dim=1, keepdim=True)
        assert torch.allclose(block.embeddings.double(), want, atol=1e-3), block.name


def encode_to(path: Path, choice, frames: int = 16, model: str = MODEL) -> Path:
    from mmkv_cli.core.options import EncodeOptions, LoadOptions, MethodSpec

    named = ("short_term_frames", "mid_term_frames", "retrieval_top_k")
    spec = MethodSpec("savemem", {name: getattr(choice.params, name) for name in named})
    options = EncodeOptions(spec, fps=4.0, max_frames=frames)
    api.encode(str(SAMPLES / "clip.mp4"), path, options, load=LoadOptions(model, "cpu"))
    return path


def expected_context(backbone, reader: PackReader, question: str, frames: int, top_k: int):
    """The blocks a question keeps, worked out plainly from the pack's embeddings: the newest
    `frames` frames' steps kept whole, the other blocks with a visual token scored."""
    short = max(1, frames // reader.header.layout.frames_per_step)
    prompt = reader.header.prompt
    ids = (backbone.text_ids(prompt.prefix) + backbone.text_ids(prompt.suffix_text)
           + backbone.question_ids(question, prompt.question))  # fmt: skip
    with torch.no_grad():
        asked = backbone.embed_ids(ids)[0].double()
    asked = asked / asked.norm(dim=1, keepdim=True)
    stored = reader.embeddings().double()
    counts = reader.blocks.layer_totals()[:, 0].tolist()
    starts = np.cumsum([0, *counts])
    steps = reader.blocks.start_steps().tolist()
    candidates = [b for b in range(len(counts)) if steps[b] <= max(steps) - short
                  and stored[starts[b] : starts[b + 1]].abs().sum() > 0]  # fmt: skip
    scores = plain_scores(stored, asked, [range(starts[b], starts[b + 1]) for b in candidates])
    keep = plain_kept(scores, top_k)
    ranked = sorted(range(len(candidates)), key=lambda c: -scores[c])  # stable: earlier first
    dropped = {candidates[c] for c in ranked[keep:]}
    return [block_name(b) for b in range(len(counts)) if b not in dropped]


@pytest.mark.parametrize("model", [MODEL, "tiny-qwen3-vl"])  # two frames a step, markers
def test_a_question_drops_the_frames_it_matches_least(tmp_path, backbones, model):
    backbone = backbones[model]
    pack = encode_to(tmp_path / "savemem.kvpack", retrieving(), 24, model)
    reader = PackReader(pack)
    assert reader.format_version == 13 and reader.embeddings() is not None
    want = expected_context(backbone, reader, QUESTION, frames=2, top_k=1)
    answer = ask_pack(pack, QUESTION, backbone=backbone, explain=True)
    assert answer.blocks_used == want and len(want) < len(reader.blocks)
    short = max(1, 2 // reader.header.layout.frames_per_step)
    steps, counts = reader.blocks.start_steps(), reader.blocks.layer_totals()[:, 0]
    starts, stored = np.cumsum([0, *counts]), reader.embeddings()
    for entry in answer.retrieved:  # the short term, and a block of markers alone: unscored
        row = reader.blocks.index_of(entry["block"])
        visual = stored[starts[row] : starts[row + 1]].abs().sum() > 0
        assert (entry["score"] is None) == (steps[row] > steps.max() - short or not visual)


def test_without_retrieval_the_pack_keeps_no_embeddings_and_asks_the_whole_memory(
    tmp_path, backbones
):
    pack = encode_to(tmp_path / "off.kvpack", retrieving(retrieval_top_k=0))
    reader = PackReader(pack)
    assert reader.embeddings() is None and "embeds" not in Parts.of(pack.read_bytes()).directory
    answer = ask_pack(pack, QUESTION, backbone=backbones[MODEL])
    assert answer.blocks_used == [reader.blocks.name(i) for i in range(len(reader.blocks))]


def test_a_v12_savemem_pack_keeps_none_and_asks_the_whole_memory(backbones):
    """tests/data/v12.kvpack: SAVEMem (2 short-term frames, 2 mid-term) written before v13."""
    reader = PackReader(DATA / "v12.kvpack")
    assert reader.format_version == 12 and reader.embeddings() is None
    answer = ask_pack(DATA / "v12.kvpack", QUESTION, backbone=backbones[MODEL])
    assert answer.blocks_used == [reader.blocks.name(i) for i in range(len(reader.blocks))]
    assert api.verify(DATA / "v12.kvpack")["ok"]


def test_live_a_question_keeps_what_the_written_pack_keeps(tmp_path, backbones):
    backbone = backbones[MODEL]
    media = media_of(24)
    choice, context = retrieving(chunk_frames=4), EncodeContext("video")
    live = LiveEncoder(backbone, choice, context)
    frames = media.read(0, media.num_frames)
    for i, at in enumerate(media.timestamps):
        live.push(frames[i], at)
        if i + 1 not in (13, 24):
            continue
        seen = Media("video", "live", "0" * 64, media.timestamps[: i + 1], None)
        encoded = live.memory()
        path = tmp_path / f"at-{i + 1}.kvpack"
        write_encoded(path, backbone, choice, context, seen, encoded)
        header, _ = pack_header(backbone, choice, context, seen, encoded)
        in_place = MemoryPack(header, encoded.prefix, encoded.blocks, encoded.suffix)
        options = AskOptions(generation=GenerationOptions(3), keep_logits=True)
        want = PackSession(path, backbone=backbone).ask(QUESTION, options)
        got = PackSession(in_place, backbone=backbone).ask(QUESTION, options)
        assert got.blocks_used == want.blocks_used and got.answer == want.answer
        assert torch.equal(got.first_logits, want.first_logits)
    assert len(want.blocks_used) < len(PackReader(path).blocks)  # the question dropped some


def big_pack(path: Path, dim: int = 3584, per_block: int = 200, blocks: int = 3) -> Path:
    """A pack whose embeddings have a 7B model's width: 600 rows, 4.3 MB, past one 4 MiB digest
    chunk."""
    gen = torch.Generator().manual_seed(0)
    made = [
        replace(fixture_segment(block_name(b), [per_block] * 3, b + 1, 3, "frame", b),
                embeddings=torch.nn.functional.normalize(torch.randn(per_block, dim, generator=gen),
                                                         dim=1))
        for b in range(blocks)
    ]  # fmt: skip
    prefix, suffix = (
        fixture_segment("prefix", [5] * 3, 0, 3),
        fixture_segment("suffix", [1] * 3, 9, 3),
    )
    write_pack(path, HEADER, prefix, made, suffix)
    return path


def test_embeddings_of_a_real_width_read_back_under_their_digests(tmp_path):
    pack = big_pack(tmp_path / "wide.kvpack")
    header = Parts.of(pack.read_bytes()).header()
    assert len(header["integrity"]["embeds"]["blake3"]) == 2  # 4.3 MB: two 4 MiB chunks
    stored = PackReader(pack).embeddings()
    assert stored.shape == (600, 3584) and stored.dtype == torch.float16
    for flip in (0, 4 * 1024 * 1024 + 10):  # a byte in each chunk
        parts = Parts.of(pack.read_bytes())
        start, _ = parts.directory["embeds"]["data_offsets"]
        parts.data[start + flip] ^= 0x01
        bad = tmp_path / f"bad-{flip}.kvpack"
        bad.write_bytes(parts.bytes())
        with pytest.raises(PackError, match="checksum mismatch in embeds"):
            PackReader(bad).embeddings()
        faults = api.verify(bad)["faults"]
        assert any(f.startswith("embeddings:") for f in faults)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["embeddings"].update(dim=3583),  # the tensor says otherwise
        lambda h: h.update(format_version=12),  # v12 keeps none
        lambda h: h["integrity"]["embeds"]["blake3"].pop(),  # a chunk left without a digest
        lambda h: h["integrity"].pop("embeds"),
        lambda h: h.update(embeddings={"dim": "x"}),
    ],
)
def test_a_forged_embeddings_header_is_refused_on_open(tmp_path, edit):
    parts = Parts.of(big_pack(tmp_path / "wide.kvpack").read_bytes())
    header = parts.header()
    edit(header)
    parts.set_header(header)
    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="corrupted"):
        PackReader(forged)


def test_nan_in_resealed_embeddings_is_refused(tmp_path):
    from mmkv_cli.pack.integrity.hashing import chunk_digests

    parts = Parts.of(big_pack(tmp_path / "wide.kvpack").read_bytes())
    start, stop = parts.directory["embeds"]["data_offsets"]
    parts.data[start : start + 2] = np.array([np.nan], np.float16).tobytes()
    header = parts.header()
    chunk = header["integrity"]["embeds"]["chunk"]
    header["integrity"]["embeds"]["blake3"] = chunk_digests(
        np.frombuffer(bytes(parts.data[start:stop]), np.uint8), chunk, "blake3"
    )
    parts.set_header(header)
    forged = tmp_path / "nan.kvpack"
    forged.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="NaN or Inf in embeds"):
        PackReader(forged).embeddings()


def test_a_convert_keeps_the_embeddings_of_the_blocks_it_keeps(tmp_path):
    pack = big_pack(tmp_path / "wide.kvpack")
    whole = PackReader(pack).embeddings()
    quantized = tmp_path / "q.kvpack"
    api.convert(pack, quantized, QuantSpec(4))
    assert torch.equal(PackReader(quantized).embeddings(), whole)
    cut = tmp_path / "cut.kvpack"
    api.convert(pack, cut, start=1.0)
    assert torch.equal(PackReader(cut).embeddings(), whole[200:])
