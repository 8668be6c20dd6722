"""Resumable encodes, and what a kill at any moment leaves: never a partial pack under its name,
never litter for long, and a resumed encode writes the pack an uninterrupted one would."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mmkv_cli import api
from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.core.options import EncodeOptions, MethodSpec
from mmkv_cli.encode.checkpoint import checkpoint_path
from mmkv_cli.pack import PackReader
from mmkv_cli.study.synth import write_dataset

MMKV = [sys.executable, "-m", "mmkv_cli"]
OPTIONS = {"max_frames": 48, "fps": 2.0, "force": True}


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    tmp = tmp_path_factory.mktemp("resume")
    write_dataset(tmp / "set", 2, 48, 3, kind="normal")
    return load_backbone(LoadOptions("demo", "cpu")), tmp


def same_pack(a: Path, b: Path) -> bool:
    """Every tensor byte and every header field equal, apart from when it was made and how long
    it took."""
    ra, rb = PackReader(a), PackReader(b)
    if replace(ra.header, created=None, stats={}) != replace(rb.header, created=None, stats={}):
        return False
    return ra._entries == rb._entries and all(
        ra._tensors.raw(name).tobytes() == rb._tensors.raw(name).tobytes() for name in ra._entries
    )


def interrupt(backbone, video: str, out: Path, method: str, chunks: int, **more) -> None:
    """Encode with a checkpoint after every chunk, stopped just after chunk `chunks` is saved."""
    calls = []

    def stop(frames, tokens):  # reported before the chunk's checkpoint is saved
        calls.append(frames)
        if len(calls) == chunks + 1:
            raise Stop

    with pytest.raises(Stop):
        options = EncodeOptions(method, checkpoint_every=1, **OPTIONS, **more)
        api.encode(video, out, options, backbone=backbone, progress=stop)


@pytest.mark.parametrize(
    ("method", "reduce"),
    [
        *((m, None) for m in ["hermes", "h2o", "meda", "infinipot", "rekv", "mukv"]),
        ("hermes", "dtd"),  # the reducer's step before is in the checkpoint too
        ("mukv", "dtd"),
        ("streamingtom", None),  # its own reducer, ctr
        ("rekv", "stc"),  # its running mean and the tower's reference frame too
    ],
)
def test_an_interrupted_encode_resumes_to_the_same_pack(world, method, reduce):
    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    whole = tmp / f"{method}-{reduce}-whole.kvpack"
    api.encode(video, whole, EncodeOptions(method, **OPTIONS, reduce=reduce), backbone=backbone)
    cut = tmp / f"{method}-{reduce}-cut.kvpack"
    interrupt(backbone, video, cut, method, chunks=2, reduce=reduce)
    assert checkpoint_path(cut).exists() and not cut.exists()
    resumed = EncodeOptions(method, checkpoint_every=1, resume=True, **OPTIONS, reduce=reduce)
    api.encode(video, cut, resumed, backbone=backbone)
    assert same_pack(whole, cut)
    assert not checkpoint_path(cut).exists()  # removed once the pack is written


def test_lazy_hermes_resumes_with_its_layers_moved(world):
    """Lazy HERMES moves layers as a whole after compressions (issue 72): how far each moved is in
    the checkpoint, so the resumed pack's prompt sits where the uninterrupted one's does."""
    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    lazy, small = MethodSpec("hermes", {"reindex": "lazy"}), {"budget_tokens": 24}
    whole = tmp / "hermes-lazy-whole.kvpack"
    api.encode(video, whole, EncodeOptions(lazy, **OPTIONS, **small), backbone=backbone)
    starts = {int(p[0, 0]) for p in PackReader(whole).span("prefix").positions}
    assert len(starts) > 1  # layers moved by different amounts
    cut = tmp / "hermes-lazy-cut.kvpack"
    interrupt(backbone, video, cut, lazy, chunks=2, **small)
    resumed = EncodeOptions(lazy, checkpoint_every=1, resume=True, **OPTIONS, **small)
    api.encode(video, cut, resumed, backbone=backbone)
    assert same_pack(whole, cut)


def test_per_head_infinipot_resumes_with_what_each_head_holds(world):
    """InfiniPot-V keeps a set per KV head while it streams (issue 72): which head holds which
    entry is in the checkpoint."""
    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    small = {"budget_tokens": 120}  # over a chunk (64 tokens): room for the heads to differ
    whole = tmp / "infinipot-small-whole.kvpack"
    api.encode(video, whole, EncodeOptions("infinipot", **OPTIONS, **small), backbone=backbone)
    assert PackReader(whole).header.kv.per_head
    cut = tmp / "infinipot-small-cut.kvpack"
    interrupt(backbone, video, cut, "infinipot", chunks=2, **small)
    resumed = EncodeOptions("infinipot", checkpoint_every=1, resume=True, **OPTIONS, **small)
    api.encode(video, cut, resumed, backbone=backbone)
    assert same_pack(whole, cut)


def test_a_checkpoint_of_another_encode_is_refused(world):
    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    out = tmp / "other.kvpack"
    interrupt(backbone, video, out, "hermes", chunks=1)
    with pytest.raises(UsageError, match="pass --resume"):  # not overwritten by mistake
        options = EncodeOptions("hermes", checkpoint_every=1, **OPTIONS)
        api.encode(video, out, options, backbone=backbone)
    with pytest.raises(UsageError, match="budget"):
        options = EncodeOptions("hermes", budget=0.5, resume=True, **OPTIONS)
        api.encode(video, out, options, backbone=backbone)
    data = bytearray(checkpoint_path(out).read_bytes())
    data[-3] ^= 0xFF
    checkpoint_path(out).write_bytes(bytes(data))
    with pytest.raises(PackError, match="checkpoint|corrupted"):
        api.encode(video, out, EncodeOptions("hermes", resume=True, **OPTIONS), backbone=backbone)


def _run(args, cwd, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([*MMKV, *args], cwd=cwd, env=env, **kw)


def _kill_after(process, seconds: float) -> None:
    time.sleep(seconds)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_killed_encodes_leave_no_partial_pack_and_resume_exactly(world):
    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0001.mp4")
    whole = tmp / "kill-whole.kvpack"
    api.encode(video, whole, EncodeOptions("hermes", **OPTIONS), backbone=backbone)
    rng = random.Random(18)
    out = tmp / "killed.kvpack"
    base = ["encode", video, "-m", "demo", "--method", "hermes", "--max-frames", "48"]
    for attempt in range(2):
        out.unlink(missing_ok=True)
        checkpoint_path(out).unlink(missing_ok=True)
        process = _run([*base, "--fps", "2", "-o", str(out), "--checkpoint-every", "1"], tmp)
        _kill_after(process, rng.uniform(2.0, 5.0))
        assert not out.exists() or same_pack(whole, out), attempt  # never a partial pack
        if not out.exists():
            args = [*base, "--fps", "2", "-o", str(out), "--checkpoint-every", "1", "--resume"]
            done = _run(args, tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert done.wait() == 0, done.stderr.read()
        assert same_pack(whole, out) and not checkpoint_path(out).exists()
    # without checkpoints, a kill in the write window leaves a partial pack of a dead process; the
    # next write to that name sweeps it
    partial = tmp / f".killed.kvpack.{2**22 + 17}.mmkv-partial"
    partial.write_bytes(b"half a pack")
    done = _run([*base, "--fps", "2", "-o", str(out), "--force"], tmp, stdout=subprocess.DEVNULL)
    assert done.wait() == 0 and not partial.exists()
    assert not [p for p in tmp.iterdir() if p.name.endswith(".mmkv-partial")]


def test_a_killed_eval_leaves_nothing_outside_its_folder_and_finishes_on_rerun(world):
    _, tmp = world
    before = {p.name for p in Path("/tmp").iterdir() if p.name.startswith("mmkv-eval")}
    args = ["eval", str(tmp / "set" / "qa.jsonl"), "-m", "demo", "--methods", "recency"]
    args += ["--budgets", "0.5", "--max-new-tokens", "2", "-o", str(tmp / "ev")]
    process = _run(args, tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_after(process, 4.0)
    after = {p.name for p in Path("/tmp").iterdir() if p.name.startswith("mmkv-eval")}
    assert after == before
    done = _run(args, tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert done.wait() == 0, done.stderr.read()
    run = tmp / "ev" / "demo" / "recency-b0.5"
    assert (run / "metrics.json").exists() and not (run / ".work").exists()


@pytest.fixture
def slid(world, monkeypatch):
    """The world, with a ReKV preset whose window slides (12 chunks of 4 frames; a 24-token
    window, so it offloads from the 3rd chunk on), `full` and recency in chunks of 4 frames, and
    checkpoints saving what does not change in pieces of 12 entries."""
    from mmkv_cli.methods import archive

    backbone, tmp = world
    presets = tmp / "presets" / "methods"
    presets.mkdir(parents=True, exist_ok=True)
    preset = "extends: rekv\nparams:\n  chunk_frames: 4\n  window_tokens: 24\n"
    (presets / "rekv-slid.yaml").write_text(preset)
    for method in ("full", "recency"):  # 12 chunks too; recency evicts from the 4th on
        (presets / f"{method}-slid.yaml").write_text(
            f"extends: {method}\nparams:\n  chunk_frames: 4\n"
        )
    monkeypatch.setenv("MMKV_PRESETS", str(tmp / "presets"))
    monkeypatch.setattr(archive, "PIECE", 12)
    return world


def test_a_resumed_encode_holds_no_loaded_tensor_past_its_use(slid, monkeypatch):
    """At an hour of video a checkpoint is GBs: the resumed encode keeps the loaded archive slabs
    themselves (no second copy), and drops every other loaded tensor once the stream moves on (the
    loaded window, replaced by the next chunk's)."""
    import gc
    import weakref

    from mmkv_cli.encode import checkpoint

    backbone, tmp = slid
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    out = tmp / "held.kvpack"
    interrupt(backbone, video, out, "rekv-slid", chunks=4)
    loaded, load = {}, checkpoint.load

    def load_watched(path, identity):
        restored, segments, sealed = load(path, identity)
        loaded.update({name: weakref.ref(t) for name, t in restored.tensors.items()})
        return restored, segments, sealed

    monkeypatch.setattr(checkpoint, "load", load_watched)
    alive = []

    def after_a_chunk(frames, tokens):
        if not alive:
            gc.collect()
            alive.extend(name for name, ref in loaded.items() if ref() is not None)

    resumed = EncodeOptions("rekv-slid", checkpoint_every=1, resume=True, **OPTIONS)
    api.encode(video, out, resumed, backbone=backbone, progress=after_a_chunk)
    adopted = [n for n in loaded if ".archive." in n and not n.endswith(".tail")]
    assert adopted and len(adopted) < len(loaded) and any(n.endswith(".tail") for n in loaded)
    assert sorted(n for n in alive if n not in adopted) == []  # the tails were copied
    assert sorted(n for n in adopted if n not in alive) == []


@pytest.mark.parametrize(
    "method,chunks", [("rekv-slid", 7), ("full-slid", 7), ("mukv", 2)]
)  # of 12, 12 and 3
def test_a_checkpoint_writes_what_never_changes_once(slid, monkeypatch, method, chunks):
    """Offloaded KV, `full`'s cache and finished blocks only grow: rewriting them at every save
    made an encode's checkpoint writes grow with the square of its length (an hour of ReKV or
    `full` at 7B: about 900 GB). Each is written once, in a segment; the head rewritten at every
    save stays the same size, its metadata too (MuKV's block rows and the segments' tensor names
    used to be listed there at every save: at an hour and full depth, MBs per save)."""
    from mmkv_cli.encode import checkpoint

    backbone, tmp = slid
    video = str(tmp / "set" / "clips" / "clip_0001.mp4")
    whole = tmp / f"once-{method}-whole.kvpack"
    api.encode(video, whole, EncodeOptions(method, **OPTIONS), backbone=backbone)
    writes, write = [], checkpoint._write

    def write_watched(target, path, tensors, meta):
        size = sum(t.nbytes for t in tensors.values())
        writes.append((target.name, set(tensors), size, len(json.dumps(meta))))
        return write(target, path, tensors, meta)

    monkeypatch.setattr(checkpoint, "_write", write_watched)
    out = tmp / f"once-{method}.kvpack"
    interrupt(backbone, video, out, method, chunks)
    segments = [w for w in writes if ".seg-" in w[0]]
    heads = [w for w in writes if ".seg-" not in w[0]]
    assert len(heads) == chunks and len(segments) >= chunks // 2 + 1
    sealed = [name for _, names, *_ in segments for name in names]
    assert len(sealed) == len(set(sealed))  # each written once
    assert not any(names & set(sealed) for _, names, *_ in heads)
    if method == "mukv":
        assert all(head_bytes == 0 for *_, head_bytes, _ in heads)
    else:  # the window, the archive's tail, the policy's state: no more as it goes (but the
        # saves' cuts, 8 bytes each)
        rest = [b - 8 * (i + 1) for i, (*_, b, _) in enumerate(heads)]
        assert max(rest[3:]) <= max(rest[:3])
    growth = [later[3] - earlier[3] for earlier, later in zip(heads, heads[1:])]
    assert max(growth) <= 120  # one segment (number, digest) a save, and the progress
    resumed = EncodeOptions(method, checkpoint_every=1, resume=True, **OPTIONS)
    api.encode(video, out, resumed, backbone=backbone)
    assert same_pack(whole, out)
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(f".{out.name}")]


def test_a_checkpoint_with_a_bad_or_missing_segment_is_refused(slid):
    from mmkv_cli.encode.checkpoint import segment_path

    backbone, tmp = slid
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    out = tmp / "segments.kvpack"
    interrupt(backbone, video, out, "rekv-slid", chunks=6)
    first = segment_path(checkpoint_path(out), 0)
    resume = EncodeOptions("rekv-slid", checkpoint_every=1, resume=True, **OPTIONS)
    data = first.read_bytes()
    first.write_bytes(data[:-2] + bytes([data[-2] ^ 0xFF]) + data[-1:])
    with pytest.raises(PackError, match="corrupted"):
        api.encode(video, out, resume, backbone=backbone)
    first.unlink()
    with pytest.raises(PackError, match="segment .*seg-0 is missing"):
        api.encode(video, out, resume, backbone=backbone)


def test_a_segment_with_other_rows_or_an_older_head_is_refused(world):
    """A segment's rows are bound to the head by its digest, as its bytes are: rows changed
    with the tensors' own digest made again are refused. A head from another checkpoint version
    is refused in one line that says so, and is left in place."""
    from mmkv_cli.encode import checkpoint

    backbone, tmp = world
    video = str(tmp / "set" / "clips" / "clip_0001.mp4")
    out = tmp / "rows.kvpack"
    interrupt(backbone, video, out, "mukv", chunks=1)
    head, first = checkpoint_path(out), checkpoint.segment_path(checkpoint_path(out), 0)
    resume = EncodeOptions("mukv", checkpoint_every=1, resume=True, **OPTIONS)
    kept = head.read_bytes()
    meta, tensors = checkpoint._read(head)
    older = {k: v for k, v in meta.items() if k != "sha256"} | {"version": 4}
    checkpoint._write(head, head, tensors, older)
    with pytest.raises(UsageError, match="another mmkv version .*v4"):
        api.encode(video, out, resume, backbone=backbone)
    assert head.exists()
    head.write_bytes(kept)
    meta, tensors = checkpoint._read(first)
    assert len(meta["rows"]) > 1
    checkpoint._write(first, head, tensors, {"rows": meta["rows"][:-1]})
    with pytest.raises(PackError, match="seg-0 is not the segment"):
        api.encode(video, out, resume, backbone=backbone)


def test_a_sliding_window_is_written_once_by_stream_index(slid, monkeypatch):
    """Recency keeps the newest tokens, so each eviction moves every entry it keeps (4.7 GB a save
    for a 25% window of an hour at 7B, when pieces were cut by cache position). Sealed by stream
    index, an entry is written once: the head stays the size of the prompt and the piece still
    filling, pieces the window left behind go once they outweigh it, and the resume takes only
    the rows still held."""
    from mmkv_cli.encode import checkpoint

    backbone, tmp = slid
    video = str(tmp / "set" / "clips" / "clip_0001.mp4")
    whole = tmp / "evicting-whole.kvpack"
    api.encode(video, whole, EncodeOptions("recency-slid", **OPTIONS), backbone=backbone)
    writes, write = [], checkpoint._write

    def write_watched(target, path, tensors, meta):
        names = {n: t.nbytes for n, t in tensors.items()}
        writes.append((".seg-" in target.name, names))
        return write(target, path, tensors, meta)

    monkeypatch.setattr(checkpoint, "_write", write_watched)
    out = tmp / "evicting.kvpack"
    interrupt(backbone, video, out, "recency-slid", chunks=11)
    heads = [
        sum(n for name, n in names.items() if ".loose." in name) for seg, names in writes if not seg
    ]
    pieces = [
        n for seg, names in writes if seg for name, n in names.items() if ".stream.k." in name
    ]
    shape = backbone.kv_shape()
    row = shape["kv_heads"] * shape["head_dim"] * 4  # one token's K (or V) in a layer
    assert max(heads) <= shape["layers"] * 12 * 2 * row  # a piece still filling, not the window
    streamed = 11 * 16 * shape["layers"] * row  # K of every token the 11 chunks gave
    assert sum(pieces) <= 2 * streamed  # each token's K about once (and again if compacted)
    resumed = EncodeOptions("recency-slid", checkpoint_every=1, resume=True, **OPTIONS)
    api.encode(video, out, resumed, backbone=backbone)
    assert same_pack(whole, out)


def test_a_checkpoint_whose_pieces_do_not_fit_its_head_is_refused(slid):
    """A head that says the stream was cut where its pieces were not (digests made again, so
    only the pieces' bookkeeping is wrong) is refused in one line."""
    from mmkv_cli.encode import checkpoint

    backbone, tmp = slid
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    out = tmp / "misfit.kvpack"
    interrupt(backbone, video, out, "full-slid", chunks=2)  # 2 pieces of 16 stream indices
    head = checkpoint_path(out)
    meta, tensors = checkpoint._read(head)
    assert tensors["cache.cuts"].tolist() == [16, 32]
    tensors["cache.cuts"] = torch.tensor([20, 32])  # 4 entries of piece 1 said in piece 0
    checkpoint._write(head, head, tensors, {k: v for k, v in meta.items() if k != "sha256"})
    resume = EncodeOptions("full-slid", checkpoint_every=1, resume=True, **OPTIONS)
    with pytest.raises(PackError, match="checkpoint is corrupted .*cache.0's piece 0 does not"):
        api.encode(video, out, resume, backbone=backbone)


# the 2026 memories, each with state of its own in the checkpoint, small enough to act on this
# clip: CausalMem's basis, foreground embeddings and per-frame backgrounds; FluxMem's short- and
# mid-term frames (embeddings, distances, choices); SAVEMem's long term and running scene
# distance beside those; DSCache's past cache, one frame a chunk, its instant cache made after
RESUMED_2026 = {
    "causalmem": (MethodSpec("causalmem", {}), {"budget_tokens": 24}, 2),
    "fluxmem": (MethodSpec("fluxmem", {"short_term_frames": 4, "mid_term_frames": 4}), {}, 2),
    "savemem": (
        MethodSpec(
            "savemem",
            {
                "short_term_frames": 4,
                "mid_term_frames": 4,
                "semantic_long_term": 4,
                "max_memory_tokens": 24,
            },
        ),
        {},
        2,
    ),  # fmt: skip
    "dscache": (MethodSpec("dscache", {"context_len": 3, "frame_len": 2}), {}, 6),
}


@pytest.mark.parametrize("name", RESUMED_2026)
def test_a_2026_memory_resumes_with_its_own_state(world, name):
    backbone, tmp = world
    method, extra, chunks = RESUMED_2026[name]
    video = str(tmp / "set" / "clips" / "clip_0000.mp4")
    whole = tmp / f"{name}-whole.kvpack"
    info = api.encode(video, whole, EncodeOptions(method, **OPTIONS, **extra), backbone=backbone)
    assert info["visual_tokens_kept"] < info["visual_tokens_total"]
    cut = tmp / f"{name}-cut.kvpack"
    interrupt(backbone, video, cut, method, chunks=chunks, **extra)
    assert checkpoint_path(cut).exists() and not cut.exists()
    resumed = EncodeOptions(method, checkpoint_every=1, resume=True, **OPTIONS, **extra)
    api.encode(video, cut, resumed, backbone=backbone)
    assert same_pack(whole, cut)
