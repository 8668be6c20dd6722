"""Packs of real size on disk (docs/scale-tests.md): a file past 4 GiB, byte offsets inside one
tensor past 2^31 and, quantized, a tensor of more than 2^31 codes. Each is a 4.5 GB file of
constant blocks (no memory to build) and is deleted once its test ends: both left in place would
hold 9 GB of temporary disk."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader, write_pack
from mmkv_cli.pack.access.report import verify
from mmkv_cli.pack.quantized.quant import QuantSpec
from tests.helpers import pack_header
from tests.mutants import Parts
from tests.scale_shapes import DIM, HEADS, LAYERS, constant_block, plain


@pytest.fixture
def big_path(tmp_path):
    path = tmp_path / "big.kvpack"
    yield path
    path.unlink(missing_ok=True)


def stored_directory(path) -> tuple[int, dict]:
    """(where the tensors' bytes start in the file, the directory of tensors)."""
    with open(path, "rb") as fh:
        data_start = 8 + int.from_bytes(fh.read(8), "little")
        fh.seek(0)
        return data_start, Parts.of(fh.read(data_start)).directory


def flip_byte(path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 0x01]))


def only_faults_of(path, name: str) -> None:
    """verify names block `name`, and nothing else."""
    report = verify(path)
    assert not report["ok"]
    assert [f for f in report["faults"] if f"block {name}:" in f] == report["faults"], report


def test_a_pack_past_4_gib_reads_verifies_and_names_a_flip_past_the_boundary(big_path, monkeypatch):
    """400 frames of 196 tokens at 7B width: blocks.k and blocks.v are 2.25 GB each (byte
    offsets inside one tensor past 2^31), the file 4.5 GB (offsets past 2^32): the last block's
    values lie wholly past 4 GiB."""
    count, tokens = 400, 196
    path = big_path
    header = pack_header(layers=LAYERS, dtype="float16", heads=HEADS, dim=DIM)
    blocks = [constant_block(i, tokens) for i in range(count)]
    write_pack(path, header, plain("prefix", 2), blocks, plain("suffix", 1))
    assert path.stat().st_size > (1 << 32) + (1 << 27)
    data_start, directory = stored_directory(path)
    start, stop = directory["blocks.v"]["data_offsets"]
    assert directory["blocks.k"]["data_offsets"][1] > 1 << 31 and start > 1 << 31
    last = data_start + stop - tokens * LAYERS * HEADS * DIM * 2  # the last block's values
    assert last > 1 << 32
    reader = PackReader(path)
    keys, values, positions = reader.gather([f"b{count - 1}", "b0"])
    for layer in (0, LAYERS - 1):
        want = torch.cat([blocks[count - 1].keys[layer], blocks[0].keys[layer]], dim=1)
        assert torch.equal(keys[layer], want) and torch.equal(values[layer], -want)
    assert positions[0][0, 0] == (count - 1) * tokens
    assert verify(path)["ok"]
    whole_tensor_in_one_read(path, "blocks.v", count, tokens, monkeypatch)
    flip_byte(path, last + 5)  # in the last block's values, past 4 GiB
    with pytest.raises(PackError, match=f"checksum mismatch in b{count - 1}"):
        PackReader(path).gather([f"b{count - 1}"])
    only_faults_of(path, f"b{count - 1}")


def whole_tensor_in_one_read(path, name: str, count: int, tokens: int, monkeypatch) -> None:
    """Tensor `name` (2.25 GB) read whole: one preadv asked for more than Linux gives in a call
    (2 GiB - 4 KiB), the loop reads the rest, and the last block's values are whole."""
    import os

    from mmkv_cli.pack.integrity.tensors import StoredTensors
    from mmkv_cli.pack.io.source import open_pack_file

    real, calls = os.preadv, []

    def watched(fd, buffers, offset):
        asked = sum(len(memoryview(b)) for b in buffers)
        got = real(fd, buffers, offset)
        calls.append((asked, got))
        return got

    monkeypatch.setattr("mmkv_cli.pack.integrity.tensors.os.preadv", watched)
    source, where = open_pack_file(path)
    whole = StoredTensors(source, where).array(name)
    monkeypatch.undo()
    assert whole.nbytes > 1 << 31
    assert any(asked > 1 << 31 and got < asked for asked, got in calls), calls
    rows = whole.reshape(count, LAYERS, tokens, HEADS, DIM)  # a block's layers one after another
    for index in (0, count - 1):
        for layer in (0, LAYERS - 1):
            assert (rows[index, layer] == np.float16(-(index + layer / 32))).all()
    del whole, rows


def test_a_quantized_pack_of_more_than_2_31_codes_in_one_tensor(big_path):
    """780 frames of 196 tokens at 7B width, 8-bit, a retrieval key a layer (so a digest a layer,
    as StreamingTOM's packs): blocks.k holds 2.19G codes, one byte each (a tensor past 2^31
    elements, where float16 needs 8 GiB), blocks.v ends past 4 GiB. An hour at 4 bits passes it
    too (350K tokens: 2.5 GB of key codes); 4 and 8 bits share every offset. Constant blocks
    decode exactly: a spanning key group holds at most two of their values, its own ends."""
    count, tokens = 780, 196
    header = pack_header(layers=LAYERS, dtype="float16", heads=HEADS, dim=DIM)
    blocks = [constant_block(i, tokens, retrieval_keys=True) for i in range(count)]
    write_pack(big_path, header, plain("prefix", 2), blocks, plain("suffix", 1), False,
               QuantSpec(8, 128))  # fmt: skip
    data_start, directory = stored_directory(big_path)
    codes = directory["blocks.k"]
    assert codes["dtype"] == "U8" and math.prod(codes["shape"]) > (1 << 31) + (1 << 24)
    assert data_start + directory["blocks.v"]["data_offsets"][1] > 1 << 32
    assert directory["blocks.blake3"]["shape"] == [count, LAYERS, 32]  # a digest a layer
    reader = PackReader(big_path)
    keys, values, _ = reader.gather([f"b{count - 1}", "b0"])
    for layer in (0, LAYERS - 1):
        want = torch.cat([blocks[count - 1].keys[layer], blocks[0].keys[layer]], dim=1)
        assert torch.equal(keys[layer], want) and torch.equal(values[layer], -want)
    # each layer its own block among the last: rows past 2^31 codes, layer by layer
    per_layer = [[f"b{count - 1 - layer}"] for layer in range(LAYERS)]
    chosen = [name for names in per_layer for name in names]
    keys, values, _ = PackReader(big_path).gather(chosen, per_layer)
    for layer in range(LAYERS):
        want = blocks[count - 1 - layer].keys[layer]
        assert torch.equal(keys[layer], want) and torch.equal(values[layer], -want)
    assert verify(big_path)["ok"]
    # a flip in the last block's key codes, more than 2^31 codes into blocks.k
    start, stop = codes["data_offsets"]
    last = stop - tokens * LAYERS * HEADS * DIM
    assert last - start > 1 << 31
    flip_byte(big_path, data_start + last + 7)
    with pytest.raises(PackError, match=f"checksum mismatch in b{count - 1}"):
        PackReader(big_path).gather([f"b{count - 1}"])
    only_faults_of(big_path, f"b{count - 1}")
