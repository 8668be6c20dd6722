"""A context read into host buffers: the runs of a per-layer eviction's pack (tens of thousands of
a few KB at 7B) described by one table handed to preadv (pack/io/vectored.py), into buffers that
layers after one another share so that each allocation is large enough for huge pages
(Staging.buffers, HOST_JOIN_BYTES)."""

from __future__ import annotations

import ctypes
import errno

import numpy as np
import pytest
import torch

import mmkv_cli.pack.io.staging as staging
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.io import vectored
from mmkv_cli.pack.io.staging import Staging
from tests.helpers import capped_rows, pack_header
from tests.scale_shapes import DIM, HEADS, LAYERS


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as handle:
        yield handle, path.read_bytes()


def test_a_table_scatters_the_files_bytes_into_its_pieces(data_file):
    handle, data = data_file
    one, two = np.zeros(5000, np.uint8), np.zeros(300, np.uint8)
    owner = np.array([0, 1, 0])
    at, sizes = np.array([100, 0, 4000]), np.array([3000, 300, 1000])
    rows = vectored.table([one, two], owner, at, sizes)
    assert vectored.read_fully(handle.fileno(), rows, 7)
    flat = np.frombuffer(data, np.uint8)
    assert (one[100:3100] == flat[7:3007]).all() and (one[:100] == 0).all()
    assert (two == flat[3007:3307]).all()
    assert (one[4000:5000] == flat[3307:4307]).all() and (one[3100:4000] == 0).all()


def test_short_reads_are_finished_and_an_end_of_file_is_reported(data_file, monkeypatch):
    """Linux gives at most 2 GiB - 4 KiB a call: a call capped at 777 bytes stops inside a piece,
    and the loop goes on from there. A file that ends first is reported, not zeros handed out."""
    handle, data = data_file
    real, calls = vectored.preadv, []

    def capped(fd, address, count, offset):
        cut = capped_rows(address, count, 777)
        calls.append(offset)
        return real(fd, cut.ctypes.data, len(cut), offset)

    monkeypatch.setattr(vectored, "preadv", capped)
    out = np.zeros((40, 100), np.uint8)
    rows = vectored.table([out], np.arange(40) * 0, np.arange(40) * 100, np.full(40, 100))
    assert vectored.read_fully(handle.fileno(), rows, 11)
    assert out.reshape(-1).tobytes() == data[11:4011]
    assert len(calls) == 6  # 4000 bytes, 777 a call
    tail = np.zeros(500, np.uint8)
    near_end = vectored.table([tail], np.array([0]), np.array([0]), np.array([500]))
    assert not vectored.read_fully(handle.fileno(), near_end, len(data) - 100)


def test_an_interrupted_call_is_made_again_and_a_failure_raised(data_file, monkeypatch):
    handle, data = data_file
    real, seen = vectored._preadv(), []

    def interrupted(fd, address, count, offset):
        seen.append(offset)
        if len(seen) == 1:
            ctypes.set_errno(errno.EINTR)
            return -1
        return real(fd, address, count, offset)

    monkeypatch.setattr(vectored, "_preadv", lambda: interrupted)
    out = np.zeros(64, np.uint8)
    rows = vectored.table([out], np.array([0]), np.array([0]), np.array([64]))
    assert vectored.read_fully(handle.fileno(), rows, 0)
    assert out.tobytes() == data[:64] and len(seen) == 2
    monkeypatch.undo()
    with pytest.raises(OSError):
        vectored.read_fully(-1, rows, 0)  # EBADF


def test_a_piece_outside_its_buffer_is_refused_before_any_read():
    out = np.zeros(100, np.uint8)
    for at, size in ((90, 11), (-1, 5), (0, -1)):
        with pytest.raises(ValueError, match="internal"):
            vectored.table([out], np.array([0]), np.array([at]), np.array([size]))
    with pytest.raises(ValueError, match="internal"):
        vectored.table([out[::2]], np.array([0]), np.array([0]), np.array([10]))


def test_small_layers_share_an_allocation_and_large_ones_have_their_own(monkeypatch):
    """Layers after one another share an allocation until it holds HOST_JOIN_BYTES (lowered to
    1 KiB: 10 rows of 100 bytes); a layer of no rows takes the shared empty buffer."""
    monkeypatch.setattr(staging, "HOST_JOIN_BYTES", 1000)
    counts = [3, 0, 4, 5, 30, 0, 2, 1, 0]
    made = Staging("cpu").buffers(counts, (25,), np.float32, "float32")
    for (array, tensor), n in zip(made, counts):
        assert array.shape == (n, 25) and tuple(tensor.shape) == (n, 25)
        assert array.flags.c_contiguous and (not n or array.ctypes.data == tensor.data_ptr())

    def base(i: int):
        array = made[i][0]
        return array.base if array.base is not None else array

    assert base(0) is base(2) is base(3)  # 12 rows: the group is full at layer 3
    assert base(4) is not base(3)  # 30 rows alone
    assert base(6) is base(7) and base(6) is not base(4)  # the rest, to the end
    assert made[1][0] is made[5][0] is made[8][0]  # no rows: one shared empty buffer
    for i, (array, _) in enumerate(made):  # every layer's rows its own bytes
        array[...] = i
    assert all((array == i).all() for i, (array, _) in enumerate(made))


def test_a_per_layer_contexts_read_is_the_same_whatever_the_buffers_sharing(tmp_path, monkeypatch):
    """A HERMES-shaped context at 7B width (each block a few tokens of each of 28 layers): read
    into buffers shared by many layers, or each layer's own, every layer's K/V are the same."""
    g = torch.Generator().manual_seed(5)

    def span(name: str, counts: list[int]) -> Span:
        kv = [torch.randn(HEADS, n, DIM, generator=g).half() for n in counts * 2]
        return Span(name, kv[:LAYERS], kv[LAYERS:], [torch.arange(n)[None] for n in counts],
                    granularity="frame", steps=(0, 1))  # fmt: skip

    body = [span(f"b{i}", torch.randint(0, 9, (LAYERS,), generator=g).tolist()) for i in range(40)]
    path = tmp_path / "few.kvpack"
    header = pack_header(LAYERS, "float16", heads=HEADS, dim=DIM)
    write_pack(path, header, span("prefix", [2] * LAYERS), body, span("suffix", [1] * LAYERS))
    names = [s.name for s in body]
    monkeypatch.setattr(staging, "HOST_JOIN_BYTES", 0)
    alone = PackReader(path).gather(names)
    assert len({k.untyped_storage().data_ptr() for k in alone[0]}) == LAYERS
    monkeypatch.setattr(staging, "HOST_JOIN_BYTES", 400 << 10)  # groups of a few layers
    shared = PackReader(path).gather(names)
    bases = {k.untyped_storage().data_ptr() for k in shared[0]}
    assert 1 < len(bases) < LAYERS
    for layer in range(LAYERS):
        want = torch.cat([s.keys[layer] for s in body], dim=1)
        assert torch.equal(shared[0][layer], want) and torch.equal(alone[0][layer], want)
        assert torch.equal(shared[1][layer], alone[1][layer])
