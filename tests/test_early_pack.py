"""A pack written while it is encoded (issue 48, item 3; pack/access/early.py, encode/sealing.py).

A method that keeps every token as prefilled (full, ReKV, StreamingTOM) has its blocks' sizes
known before the first frame: each chunk's blocks are written by a thread of their own while the
next chunks go in. The pack is the one written at the end, tensor for tensor; only its head's
padding differs. Below 64 MiB of K/V, and on the CPU, a pack is written at the end (the tests lower
that to 0 and let the CPU write early)."""

from __future__ import annotations

import errno
import json
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import mmkv_cli.encode.sealing as sealing
import mmkv_cli.pack.access.early as early
from mmkv_cli import api
from mmkv_cli.core.errors import PackError
from mmkv_cli.core.options import EncodeOptions, MethodSpec
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.encode.record import EarlyWrite
from mmkv_cli.kernels.syncs import SyncCounter
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.pack import Span, write_pack
from mmkv_cli.pack.access.report import verify
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import META_HEADER, BlockShape
from tests.conftest import SAMPLES
from tests.helpers import choose, pack_header

CLIP = SAMPLES / "clip.mp4"


@pytest.fixture(scope="module")
def demo():
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    return load_backbone(LoadOptions("demo", "cpu"))


@pytest.fixture
def always(monkeypatch):
    """Every pack of a keep-everything method written early, however small, on the CPU too."""
    monkeypatch.setattr(early, "EARLY_BYTES", 0)
    monkeypatch.setattr(sealing, "ON_CPU", True)
    finished: list[bool] = []  # per early pack: written as planned (True), or the ordinary way
    real, ordinary = early.EarlyPack.finish, early.write_pack
    fell_back: list[int] = []

    def write_pack(*args, **kwargs):
        fell_back.append(1)
        return ordinary(*args, **kwargs)

    def finish(self, *args, **kwargs):
        fell_back.clear()
        size = real(self, *args, **kwargs)
        finished.append(not fell_back)
        return size

    monkeypatch.setattr(early, "write_pack", write_pack)
    monkeypatch.setattr(early.EarlyPack, "finish", finish)
    return finished


def options(method: str, bits=None, **params) -> EncodeOptions:
    spec = MethodSpec(method, {"chunk_frames": 4, **params})
    return EncodeOptions(spec, max_frames=16, fps=4.0, kv_bits=bits, force=True)


def directory(path) -> tuple[dict, dict]:
    """(the directory, the header without what differs from one encode to the next)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    found = json.loads(raw[8 : 8 + length])
    header = json.loads(found.pop("__metadata__")[META_HEADER])
    for varies in ("stats", "created"):
        header.pop(varies)
    return found, header


# StreamingTOM: its CTR reducer keeps a fixed count of every frame's tokens, stored 4-bit
CASES = [("full", None), ("full", 4), ("rekv", None), ("rekv", 2), ("rekv", 1.5),
         ("rekv-paper", None), ("streamingtom", None)]  # fmt: skip
WINDOWED = ("rekv", "rekv-paper", "streamingtom")  # a window the demo's 16 frames pass


@pytest.mark.parametrize(("method", "bits"), CASES)
def test_a_pack_written_while_encoding_is_the_pack_written_after(
    demo, tmp_path, monkeypatch, always, method, bits
):
    """Every tensor, the directory and the header (but for the encode's figures) are the same as
    the pack written at the end; it verifies; and it was written as planned, not the fallback."""
    made = tmp_path / "early.kvpack"
    api.encode(str(CLIP), made, options(method, bits, window_tokens=20) if method in WINDOWED
               else options(method, bits), backbone=demo)  # fmt: skip
    assert always == [True]
    monkeypatch.setattr(sealing, "worth_writing_early", lambda *_: False)
    plain = tmp_path / "plain.kvpack"
    api.encode(str(CLIP), plain, options(method, bits, window_tokens=20) if method in WINDOWED
               else options(method, bits), backbone=demo)  # fmt: skip
    assert always == [True]  # the second was written at the end
    want, got = load_file(plain), load_file(made)
    assert want.keys() == got.keys() and "blocks.k" in got and len(got["blocks.table"]) == 16
    if method == "streamingtom":  # reduced before the prefill, and stored 4-bit
        assert "blocks.kq" in got and int(got["blocks.table"][:, -1].sum()) < 16 * 196
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert directory(made) == directory(plain)
    assert verify(made)["ok"]
    assert made.stat().st_size - plain.stat().st_size <= early.HEAD_SLACK + 8


def test_blocks_are_written_while_the_next_chunks_go_in(demo, tmp_path, monkeypatch, always):
    """Each chunk after the first waits (here) until the writer's thread has made the blocks of
    every chunk before it: an encode that wrote at the end would never get past the second."""
    real = sealing.Sealing.chunk
    seen: list[int] = []

    def chunk(self, state, steps):
        deadline = time.monotonic() + 60
        while len(self.pack.blocks) < self.steps:
            assert time.monotonic() < deadline, "the writer made no block while encoding"
            time.sleep(0.005)
        seen.append(len(self.pack.blocks))
        real(self, state, steps)

    threads: set[str] = set()
    step_block = KeepAll.step_block

    def watched(self, *args):
        threads.add(threading.current_thread().name)
        return step_block(self, *args)

    monkeypatch.setattr(sealing.Sealing, "chunk", chunk)
    monkeypatch.setattr(KeepAll, "step_block", watched)
    out = tmp_path / "p.kvpack"
    api.encode(str(CLIP), out, options("full"), backbone=demo)
    assert seen == [0, 4, 8, 12] and always == [True]  # 4 chunks of 4 frames (steps)
    assert "mmkv-pack-writer" in threads
    assert verify(out)["ok"]


def test_an_encode_that_fails_leaves_no_file_behind(demo, tmp_path, monkeypatch, always):
    real = demo.forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the prompt, two chunks, then a failure
            raise RuntimeError("the device fell off the bus")
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "forward", forward)
    out = tmp_path / "p.kvpack"
    with pytest.raises(RuntimeError, match="fell off"):
        api.encode(str(CLIP), out, options("full"), backbone=demo)
    assert list(tmp_path.iterdir()) == []
    assert not any(t.name == "mmkv-pack-writer" for t in threading.enumerate())


def test_a_write_that_fails_is_one_line_and_leaves_no_file(demo, tmp_path, monkeypatch, always):
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(early, "write_blocks", full_disk)
    out = tmp_path / "p.kvpack"
    with pytest.raises(PackError, match=r"^cannot write .*: No space left on device$"):
        api.encode(str(CLIP), out, options("full"), backbone=demo)
    assert list(tmp_path.iterdir()) == []


def test_methods_that_evict_reducers_and_checkpoints_write_at_the_end(demo, tmp_path, always):
    for method, more in (("hermes", {}), ("full", {"reduce": "dtd"}),
                         ("full", {"checkpoint_every": 1})):  # fmt: skip
        opts = options(method)
        opts = EncodeOptions(**{**opts.__dict__, **more})
        api.encode(str(CLIP), tmp_path / "p.kvpack", opts, backbone=demo)
    assert always == []


def test_on_the_cpu_a_pack_is_written_at_the_end(demo, tmp_path, monkeypatch):
    monkeypatch.setattr(early, "EARLY_BYTES", 0)
    opened = []
    monkeypatch.setattr(early.EarlyPack, "__init__", lambda *a, **k: opened.append(1))
    api.encode(str(CLIP), tmp_path / "p.kvpack", options("full"), backbone=demo)
    assert opened == [] and verify(tmp_path / "p.kvpack")["ok"]


def span(name: str, tokens: int, seed: int, layers: int = 3) -> Span:
    g = torch.Generator().manual_seed(seed)
    return Span(
        name=name,
        keys=[torch.randn(2, tokens, 8, generator=g).half() for _ in range(layers)],
        values=[torch.randn(2, tokens, 8, generator=g).half() for _ in range(layers)],
        positions=[torch.arange(tokens).expand(3, -1) + 10 * seed] * layers,
        granularity="frame",
        steps=(seed, seed + 1),
        time=(float(seed), seed + 0.5),
        representative=torch.randn(1, 16, generator=g).half(),
    )


@pytest.mark.parametrize("bits", [None, 4])
def test_a_block_unlike_its_plan_makes_the_ordinary_pack(tmp_path, bits):
    """Blocks of 3, 5 and 2 tokens, the second planned as 4: the pack is still the right one."""
    blocks = [span("b0", 3, 0), span("b1", 5, 1), span("b2", 2, 2)]
    header = pack_header(layers=3, dtype="float16", heads=2, dim=8)
    prefix, suffix = span("prefix", 2, 7), span("suffix", 1, 8)
    quant = QuantSpec(bits or 16, 2)
    shapes = [BlockShape("frame", b.steps, b.time, [n] * 3, True, b.representative)
              for b, n in zip(blocks, (3, 4, 2))]  # fmt: skip
    pack = early.EarlyPack(tmp_path / "e.kvpack", header, prefix, shapes, blocks[0], suffix,
                           quant=quant)  # fmt: skip
    pack.add(lambda: blocks[:2])
    pack.add(lambda: blocks[2:])
    pack.finish(header, prefix, suffix)
    write_pack(tmp_path / "o.kvpack", header, prefix, blocks, suffix, quant=quant)
    assert (tmp_path / "e.kvpack").read_bytes() == (tmp_path / "o.kvpack").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.kvpack", "o.kvpack"]


def test_a_head_past_its_room_makes_the_ordinary_pack(demo, tmp_path, monkeypatch, always):
    monkeypatch.setattr(early, "HEAD_SLACK", -64)  # the final head cannot fit
    out = tmp_path / "p.kvpack"
    api.encode(str(CLIP), out, options("full"), backbone=demo)
    assert always == [False] and verify(out)["ok"]
    raw = out.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert len(raw[8 : 8 + length].rstrip(b" ")) > length - 8  # no room left: padded to 8 only
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_the_early_threshold_at_7b_width():
    """LLaVA-OV-7B: 28 layers x 4 KV heads x 128 channels, 196 tokens a frame, 11.2 MB of fp16
    K/V a frame: 64 MiB is passed at the sixth frame, and twice over at the twelfth."""
    first = Span("b0", [torch.zeros(4, 1, 128, dtype=torch.float16)] * 28, [], [])

    def frames(n: int) -> list[BlockShape]:
        return [BlockShape("frame", (i, i + 1), None, [196] * 28, True, None) for i in range(n)]

    assert [early.worth_writing_early(frames(n), first) for n in (1, 5, 6, 12, 3600)] == [
        False, False, True, True, True,
    ]  # fmt: skip


# the bounds of test_host_syncs: StreamingTOM's CTR reads its counts, then its keep, a chunk
@pytest.mark.parametrize(("method", "bound"), [("full", 1), ("rekv", 1), ("streamingtom", 2)])
def test_writing_while_encoding_adds_no_wait_a_chunk(demo, tmp_path, monkeypatch, method, bound):
    """The blocks leave the device on a side stream; the writer's thread waits for them, the
    encode never does (counted on this thread, as test_host_syncs counts every encode)."""
    monkeypatch.setattr(early, "EARLY_BYTES", 0)
    monkeypatch.setattr(sealing, "ON_CPU", True)
    window = {"window_tokens": 20} if method in WINDOWED else {}
    choice = choose(method, chunk_frames=4, **window)
    counts = []
    for chunks in (2, 4):
        media = load_media(str(CLIP), fps=4, max_frames=4 * chunks)
        context = EncodeContext(media.kind)
        target = EarlyWrite(tmp_path / f"{chunks}.kvpack", demo, choice, context, media)
        counter = SyncCounter()
        counter.on_device(demo.device)
        with counter.counting(demo.model):
            encoded = encode_media(demo, media, choice, context, early=target)
        assert encoded.early is not None
        encoded.early.abandon()
        counts.append(counter.total)
    assert (counts[1] - counts[0]) / 2 <= bound, counts
