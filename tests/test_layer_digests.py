"""A digest a layer (format v12): a pack retrieved layer by layer (per-layer retrieval keys) gives
each block one digest per model layer, so a layer's retrieval checks the rows it reads, not the
block's every layer (at 7B: 28 times the bytes, the most of ReKV's question on an H100)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from blake3 import blake3

from mmkv_cli import api
from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.access.writer import layers_per_digest
from mmkv_cli.pack.integrity import hashing
from tests.helpers import pack_header
from tests.mutants import Parts

DATA = Path(__file__).parent / "data"
LAYERS, HEADS, DIM = 4, 2, 8


def block(name: str, counts: list[int], seed: int, reps: bool = True) -> Span:
    """A block whose layers keep `counts` tokens (different positions each: stored per layer)."""
    g = torch.Generator().manual_seed(seed)
    return Span(
        name=name,
        keys=[torch.randn(HEADS, n, DIM, generator=g) for n in counts],
        values=[torch.randn(HEADS, n, DIM, generator=g) for n in counts],
        positions=[
            torch.arange(n).expand(3, -1) + 10 * seed + layer for layer, n in enumerate(counts)
        ],  # fmt: skip
        granularity="frame",
        steps=(seed, seed + 1),
        time=(float(seed), seed + 0.5),
        representative=torch.randn(len(counts), HEADS * DIM, generator=g) if reps else None,
    )


def prompt(name: str, tokens: int) -> Span:
    return Span(
        name=name,
        keys=[torch.zeros(HEADS, tokens, DIM)] * LAYERS,
        values=[torch.ones(HEADS, tokens, DIM)] * LAYERS,
        positions=[torch.arange(tokens).expand(3, -1)] * LAYERS,
    )


COUNTS = [[3, 2, 0, 5], [4, 4, 4, 4], [1, 6, 2, 3]]


def write(path: Path, reps: bool = True) -> list[Span]:
    blocks = [block(f"b{i}", counts, i, reps) for i, counts in enumerate(COUNTS)]
    header = pack_header(layers=LAYERS, dtype="float32", heads=HEADS, dim=DIM)
    write_pack(path, header, prompt("prefix", 2), blocks, prompt("suffix", 1))
    return blocks


def stored_rows(layers: list[torch.Tensor]) -> bytes:
    return b"".join(t.transpose(0, 1).contiguous().numpy().tobytes() for t in layers)


def positions_rows(span: Span, layers: range) -> bytes:
    return b"".join(span.positions[i].T.to(torch.int32).contiguous().numpy().tobytes()
                    for i in layers)  # fmt: skip


def test_each_layer_of_a_retrieved_pack_has_a_digest_of_its_own_rows(tmp_path):
    blocks = write(tmp_path / "p.kvpack")
    parts = Parts.of((tmp_path / "p.kvpack").read_bytes())
    assert parts.header()["blocks"]["digest_layers"] == 1
    digests = np.frombuffer(bytes(parts.data[slice(*parts.directory["blocks.blake3"]
                                                     ["data_offsets"])]), np.uint8)  # fmt: skip
    assert parts.directory["blocks.blake3"]["shape"] == [3, LAYERS, 32]
    for i, span in enumerate(blocks):
        for layer in range(LAYERS):
            want = blake3(
                stored_rows(span.keys[layer : layer + 1])
                + stored_rows(span.values[layer : layer + 1])
                + positions_rows(span, range(layer, layer + 1))
            ).digest()
            at = (i * LAYERS + layer) * 32
            assert digests[at : at + 32].tobytes() == want, (i, layer)


def test_a_pack_without_retrieval_keys_keeps_one_digest_a_block(tmp_path):
    blocks = write(tmp_path / "p.kvpack", reps=False)
    parts = Parts.of((tmp_path / "p.kvpack").read_bytes())
    assert parts.header()["blocks"]["digest_layers"] == LAYERS
    assert parts.directory["blocks.blake3"]["shape"] == [3, 1, 32]
    start = parts.directory["blocks.blake3"]["data_offsets"][0]
    span = blocks[2]
    whole = stored_rows(span.keys) + stored_rows(span.values) + positions_rows(span, range(LAYERS))
    assert bytes(parts.data[start + 64 : start + 96]) == blake3(whole).digest()


def test_digest_runs_follow_the_retrieval_keys_layers():
    reps = torch.zeros(3, 4, 16)
    assert layers_per_digest(4, reps) == 1
    assert layers_per_digest(8, reps) == 2  # held per head: a layer's two KV heads together
    assert layers_per_digest(6, reps) == 6  # keys that do not cut the layers: one a block
    assert layers_per_digest(4, None) == 4
    assert layers_per_digest(4, torch.zeros(3, 1, 16)) == 4  # one key a block


def flipped(path: Path, out: Path, block: int, layer: int) -> Path:
    """The pack at `path` with one byte of block `block`'s keys at `layer` flipped."""
    parts = Parts.of(path.read_bytes())
    row = sum(map(sum, COUNTS[:block])) + sum(COUNTS[block][:layer])
    start = parts.directory["blocks.k"]["data_offsets"][0] + row * HEADS * DIM * 4
    parts.data[start + 5] ^= 0x20
    out.write_bytes(parts.bytes())
    return out


def only(layer: int, names: list[str]) -> list[list[str]]:
    return [names if i == layer else [] for i in range(LAYERS)]


def test_a_layer_reads_past_a_flip_in_another_layer_and_is_refused_at_its_own(tmp_path):
    blocks = write(tmp_path / "p.kvpack")
    bad = flipped(tmp_path / "p.kvpack", tmp_path / "bad.kvpack", 1, 2)
    reader = PackReader(bad)
    keys, values, _ = reader.gather(["b1", "b2"], only(0, ["b1", "b2"]))
    assert torch.equal(keys[0], torch.cat([blocks[1].keys[0], blocks[2].keys[0]], dim=1))
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        reader.gather(["b1"], only(2, ["b1"]))
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(bad).gather(["b1"])  # every layer: the flipped one among them
    report = api.verify(bad)
    assert not report["ok"] and any("b1" in fault for fault in report["faults"])


def test_a_layer_checked_once_is_not_hashed_again_but_the_next_layer_is(tmp_path, monkeypatch):
    write(tmp_path / "p.kvpack")
    reader = PackReader(tmp_path / "p.kvpack")
    hashed: list[int] = []
    real = hashing.BlockHashes.__init__

    def counted(self, views, where, units, *args, **kwargs):
        hashed.append(len(units))
        real(self, views, where, units, *args, **kwargs)

    monkeypatch.setattr(hashing.BlockHashes, "__init__", counted)
    reader.gather(["b0", "b1"], only(1, ["b0", "b1"]))
    reader.gather(["b0", "b1"], only(1, ["b0", "b1"]))
    reader.gather(["b0", "b1"], only(3, ["b1"]))
    assert hashed == [2, 0, 1]


def test_a_v11_pack_retrieved_by_layer_still_checks_whole_blocks(tmp_path):
    """tests/data/v11.kvpack: a ReKV pack of the tiny LLaVA-OV (4 layers) written before v12."""
    reader = PackReader(DATA / "v11.kvpack")
    assert reader.format_version == 11 and reader.representatives().shape[1] == 4
    assert api.verify(DATA / "v11.kvpack")["ok"]
    keys, *_ = reader.gather(["b0", "b3"], only(2, ["b3"]))
    assert keys[2].shape[1] == reader.blocks[3]["layer_counts"][2] and keys[0].shape[1] == 0
    parts = Parts.of((DATA / "v11.kvpack").read_bytes())
    start = parts.directory["blocks.v"]["data_offsets"][0]
    parts.data[start + 3] ^= 0x10  # block b0, layer 0
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="checksum mismatch in b0"):
        PackReader(bad).gather(["b0"], only(3, ["b0"]))  # one digest a block: any layer's read


@pytest.mark.parametrize("runs", [0, 3, "4"])
def test_digest_runs_that_do_not_cut_the_layers_are_refused(tmp_path, runs):
    write(tmp_path / "p.kvpack")
    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(
        Parts.with_header(tmp_path / "p.kvpack", lambda h: h["blocks"].update(digest_layers=runs))
    )
    with pytest.raises(PackError, match="digest_layers"):
        PackReader(forged)
    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app

    shown = CliRunner().invoke(app, ["verify", str(forged)])
    assert shown.exit_code == 4 and "blocks.digest_layers" in shown.output


def test_a_v12_pack_must_say_its_digest_runs(tmp_path):
    write(tmp_path / "p.kvpack")
    shutil.copy(tmp_path / "p.kvpack", tmp_path / "kept.kvpack")
    (tmp_path / "p.kvpack").write_bytes(
        Parts.with_header(tmp_path / "p.kvpack", lambda h: h["blocks"].pop("digest_layers"))
    )
    with pytest.raises(PackError, match="digest_layers"):
        PackReader(tmp_path / "p.kvpack")
    assert PackReader(tmp_path / "kept.kvpack").blocks[0]["digest"]


def test_a_layers_few_blocks_are_hashed_on_several_threads(tmp_path, monkeypatch):
    """A layer's read of a few blocks is a digest each: runs of them go to several threads, not
    one run of a whole block's worth of digests (that is for reads of every layer of blocks)."""
    from mmkv_cli.pack.schema.table import BlockRows

    monkeypatch.setattr(hashing, "RUN_BYTES", 1)  # a digest a run here, as 400 KB ones are at 7B
    monkeypatch.setattr(hashing, "PARALLEL_HASH_BLOCK_BYTES", 0)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    write(tmp_path / "p.kvpack")
    reader = PackReader(tmp_path / "p.kvpack")
    store = reader._block_store()
    where = BlockRows(reader.blocks, [0, 1, 2], 1)
    one_layer = where.units_taken([np.arange(3) if i == 1 else np.arange(0) for i in range(LAYERS)])
    assert store.hashes(where, one_layer).threads() == 3  # a run a block's digest
    assert store.hashes(where, where.all_units()).threads() == 3  # a run a block's 4 digests


@pytest.mark.parametrize("bits", [16, 4])
def test_the_layers_a_read_skips_share_one_empty_buffer(tmp_path, monkeypatch, bits):
    """ReKV's reading inside the forward reads one layer at a time: the other layers take no rows,
    and share one empty buffer (each had a pinned buffer and a copy of its own, 27 a layer at 7B);
    the layer read is as a read of every layer gives it."""
    from mmkv_cli.pack.io.staging import Staging
    from mmkv_cli.pack.quantized.quant import QuantSpec

    blocks = [block(f"b{i}", counts, i) for i, counts in enumerate(COUNTS)]
    header = pack_header(layers=LAYERS, dtype="float32", heads=HEADS, dim=DIM)
    path = tmp_path / "p.kvpack"
    quant = QuantSpec(bits, 4) if bits != 16 else None
    write_pack(path, header, prompt("prefix", 2), blocks, prompt("suffix", 1), quant=quant)
    whole = PackReader(path).gather(["b0", "b2"])
    made: list[int] = []
    real = Staging._made

    def counted(self, rows, *args):
        made.append(rows)
        return real(self, rows, *args)

    monkeypatch.setattr(Staging, "_made", counted)
    keys, values, positions = PackReader(path).gather(["b0", "b2"], only(3, ["b0", "b2"]))
    assert made.count(0) <= (2 if bits == 16 else 0)  # one a part (K, V) at most
    for layer in range(LAYERS):
        if layer == 3:
            assert torch.equal(keys[3], whole[0][3]) and torch.equal(values[3], whole[1][3])
            assert torch.equal(positions[3], whole[2][3])
        else:
            assert keys[layer].shape == (HEADS, 0, DIM) and values[layer].shape == (HEADS, 0, DIM)
            assert positions[layer].shape[1] == 0


@pytest.mark.parametrize("seed", [3, 8])
def test_verify_names_a_resealed_nan_in_one_layer_of_a_block(tmp_path, seed):
    """verify reads each block's layers side by side and joins each layer's parts into one
    update: a NaN a forger sealed into one layer's rows is named, once, by its block."""
    import random

    from tests import mutants

    write(tmp_path / "p.kvpack")
    forged = tmp_path / "nan.kvpack"
    raw = (tmp_path / "p.kvpack").read_bytes()
    forged.write_bytes(mutants.nonfinite(Parts.of(raw), random.Random(seed), "blocks.v"))
    faults = api.verify(forged)["faults"]
    assert len(faults) == 1 and "NaN or Inf" in faults[0], faults
    assert api.verify(tmp_path / "p.kvpack")["ok"]


def deferring(monkeypatch) -> list:
    """Every read of more than one unit hashed on threads, on as many cores as a GPU machine has,
    so a question's reads leave their checksums to finish; returns a list that grows by each
    read's hashes left so."""
    from mmkv_cli.pack.access import reader as reading

    monkeypatch.setattr(hashing, "PARALLEL_HASH_BLOCK_BYTES", 0)
    monkeypatch.setattr(hashing, "RUN_BYTES", 1)  # a run a unit
    monkeypatch.setattr(hashing.os, "cpu_count", lambda: 16)  # as a GPU machine's
    left: list = []

    def counted(hashes):
        left.append(hashes)
        return hashing.mismatched_later(hashes)

    monkeypatch.setattr(reading, "mismatched_later", counted)
    return left


def test_a_question_takes_rows_whose_checksums_are_still_computed_and_waits_for_them(
    tmp_path, monkeypatch
):
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    blocks = write(tmp_path / "p.kvpack")
    bad = flipped(tmp_path / "p.kvpack", tmp_path / "bad.kvpack", 1, 2)
    left = deferring(monkeypatch)
    later = LaterVerdicts(str(bad))
    reader = PackReader(bad)
    keys, _, _ = reader.gather(["b1", "b2"], only(2, ["b1", "b2"]), later=later)
    assert len(left) == 1  # the flipped layer's rows handed over before their verdict
    assert keys[2].shape[1] == COUNTS[1][2] + COUNTS[2][2]
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        later.check_reads()
    later.check_reads()  # each verdict is read once
    # an intact read: the same rows as one checked at once, and its units then count as checked
    later = LaterVerdicts(str(tmp_path / "p.kvpack"))
    reader = PackReader(tmp_path / "p.kvpack")
    keys, values, _ = reader.gather(["b0", "b2"], only(3, ["b0", "b2"]), later=later)
    later.check_reads()
    assert torch.equal(keys[3], torch.cat([blocks[0].keys[3], blocks[2].keys[3]], dim=1))
    assert torch.equal(values[3], torch.cat([blocks[0].values[3], blocks[2].values[3]], dim=1))
    # the buffers hashed were let go once hashed (on a GPU: pinned memory the next read reuses)
    assert all(hashes._read is None for hashes in left)
    reader.gather(["b0", "b2"], only(3, ["b0", "b2"]), later=later)
    assert len(left) == 2  # nothing left to hash the second time


def test_without_a_question_to_wait_a_read_is_refused_at_once(tmp_path, monkeypatch):
    write(tmp_path / "p.kvpack")
    bad = flipped(tmp_path / "p.kvpack", tmp_path / "bad.kvpack", 1, 2)
    left = deferring(monkeypatch)
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(bad).gather(["b1", "b2"], only(2, ["b1", "b2"]))
    assert left == []


def test_small_units_read_by_layer_are_hashed_in_stretches(tmp_path, monkeypatch):
    """A retrieval's small units (StreamingTOM's: 27 KB at 7B) are checked in stretches of
    neighbours of one size, each joined with one numpy call: an honest read never falls back to
    a unit at a time, and a flip in one unit still names its block."""
    from mmkv_cli.pack.integrity import read_units

    # sizes change between blocks, so stretches are cut by size as well as by the picks
    counts = [[2 + (i // 7) % 3] * LAYERS for i in range(30)]
    blocks = [block(f"b{i}", c, i) for i, c in enumerate(counts)]
    header = pack_header(layers=LAYERS, dtype="float32", heads=HEADS, dim=DIM)
    write_pack(tmp_path / "p.kvpack", header, prompt("prefix", 2), blocks, prompt("suffix", 1))
    rng = np.random.default_rng(0)
    picks = [sorted(rng.choice(30, 17, replace=False).tolist()) for _ in range(LAYERS)]
    names = [f"b{i}" for i in sorted(set().union(*picks))]
    per_layer = [[f"b{i}" for i in p] for p in picks]
    singly, stretches = [], []
    each, check = read_units.ReadUnits._check_each, read_units.ReadUnits.check
    monkeypatch.setattr(
        read_units.ReadUnits, "_check_each", lambda s, run: singly.append(run) or each(s, run)
    )
    monkeypatch.setattr(
        read_units.ReadUnits, "check", lambda s, run: stretches.append(len(run)) or check(s, run)
    )
    keys, _, _ = PackReader(tmp_path / "p.kvpack").gather(names, per_layer)
    for layer, p in enumerate(picks):
        assert torch.equal(keys[layer], torch.cat([blocks[i].keys[layer] for i in p], dim=1))
    assert not singly and sum(stretches) == sum(map(len, picks)) and max(stretches) > 1
    # a flip in one unit: its own digest in the stretch names its block
    hit = picks[2][3]
    row = sum(map(sum, counts[:hit])) + sum(counts[hit][:2])  # its layer 2
    parts = Parts.of((tmp_path / "p.kvpack").read_bytes())
    parts.data[parts.directory["blocks.k"]["data_offsets"][0] + row * HEADS * DIM * 4 + 3] ^= 1
    (tmp_path / "bad.kvpack").write_bytes(parts.bytes())
    with pytest.raises(PackError, match=rf"checksum mismatch in b{hit}\)"):
        PackReader(tmp_path / "bad.kvpack").gather(names, per_layer)
    assert not singly
    # a NaN forged under a re-sealed checksum: the stretch holding it is checked a unit at a time
    from tests.mutants import _reseal_block

    parts = Parts.of((tmp_path / "p.kvpack").read_bytes())
    at = parts.directory["blocks.v"]["data_offsets"][0] + row * HEADS * DIM * 4
    parts.data[at : at + 4] = np.float32("nan").tobytes()
    _reseal_block(parts, parts.header(), "blocks.v", row)
    parts.reseal()
    (tmp_path / "nan.kvpack").write_bytes(parts.bytes())
    with pytest.raises(PackError, match=rf"NaN or Inf in the K/V of b{hit}\)"):
        PackReader(tmp_path / "nan.kvpack").gather(names, per_layer)
    assert singly


def test_a_questions_small_units_hashed_as_read_are_left_to_finish(tmp_path, monkeypatch):
    """On a GPU machine's cores a question leaves even units too small for threads (hashed on
    one, as StreamingTOM's 27 KB ones) to finish beside it, and its first token waits for them."""
    from mmkv_cli.pack.access import reader as reading
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    blocks = write(tmp_path / "p.kvpack")
    bad = flipped(tmp_path / "p.kvpack", tmp_path / "bad.kvpack", 1, 2)
    monkeypatch.setattr(hashing.os, "cpu_count", lambda: 16)
    left: list = []
    monkeypatch.setattr(
        reading, "mismatched_later", lambda h: left.append(h) or hashing.mismatched_later(h)
    )
    later = LaterVerdicts(str(bad))
    keys, _, _ = PackReader(bad).gather(["b1", "b2"], only(2, ["b1", "b2"]), later=later)
    assert len(left) == 1 and left[0].threads() == 1  # one thread, not waited for
    assert keys[2].shape[1] == COUNTS[1][2] + COUNTS[2][2]
    assert torch.equal(keys[2][:, COUNTS[1][2] :], blocks[2].keys[2])
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        later.check_reads()
    monkeypatch.setattr(hashing.os, "cpu_count", lambda: 2)  # too few cores to leave them
    with pytest.raises(PackError, match="checksum mismatch in b1"):
        PackReader(bad).gather(["b1", "b2"], only(2, ["b1", "b2"]), later=LaterVerdicts(str(bad)))
    assert len(left) == 1


@pytest.mark.parametrize("join_bytes", [None, 300])
def test_verify_hashes_even_layers_at_once_and_still_names_each_flipped_layer(
    tmp_path, monkeypatch, join_bytes
):
    """verify joins a block's small per-layer units part by part with one numpy copy each where
    every layer holds as many rows (b1; b3, whose positions all layers share, stored once) and
    unit by unit elsewhere (b0, b2), or where a unit passes JOIN_BYTES (lowered to 300 here, under
    b1's 560 and b3's 420): a flip in any layer of any block is named, that block alone."""
    if join_bytes is not None:
        monkeypatch.setattr(hashing, "JOIN_BYTES", join_bytes)
    counts = [*COUNTS, [3, 3, 3, 3]]
    blocks = [block(f"b{i}", c, i) for i, c in enumerate(COUNTS)]
    shared = block("b3", counts[3], 3)
    blocks.append(Span(**{**shared.__dict__, "positions": [shared.positions[0]] * LAYERS}))
    header = pack_header(layers=LAYERS, dtype="float32", heads=HEADS, dim=DIM)
    path = tmp_path / "p.kvpack"
    write_pack(path, header, prompt("prefix", 2), blocks, prompt("suffix", 1))
    evenly: list[tuple[str, bool]] = []
    real = hashing.BlockHashes._hashed_evenly

    def watched(self, first, stop, read):
        evenly.append((f"b{self._blocks[first]}", real(self, first, stop, read)))
        return evenly[-1][1]

    monkeypatch.setattr(hashing.BlockHashes, "_hashed_evenly", watched)
    assert api.verify(path)["ok"]
    even = join_bytes is None
    assert dict(evenly) == {"b0": False, "b1": even, "b2": False, "b3": even}
    parts = Parts.of(path.read_bytes())
    start = parts.directory["blocks.k"]["data_offsets"][0]
    for i, layers in enumerate(counts):
        for layer, n in enumerate(layers):
            if not n:
                continue
            row = sum(map(sum, counts[:i])) + sum(layers[:layer])
            bad = Parts.of(path.read_bytes())
            bad.data[start + row * HEADS * DIM * 4 + 3] ^= 0x10
            (tmp_path / "bad.kvpack").write_bytes(bad.bytes())
            faults = api.verify(tmp_path / "bad.kvpack")["faults"]
            assert len(faults) == 1 and f"b{i}" in faults[0], (i, layer, faults)
