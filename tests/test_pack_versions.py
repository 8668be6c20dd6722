"""Older packs stay readable: tests/data/v3.kvpack, v6.kvpack and v7.kvpack were written by the
format-v3, v6 and v7 writers from `fixture()`, v8q.kvpack by the v8 writer, 4-bit, and v9.kvpack
and v9q.kvpack (4-bit, key groups of 2 tokens) by the v9 writer, the last with sha256 checksums."""

from pathlib import Path

import numpy as np
import pytest
import torch

from mmkv_cli import api
from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.access.writer import narrowed
from mmkv_cli.pack.integrity.checks import read_directory
from mmkv_cli.pack.schema.format import FORMAT_VERSION
from mmkv_cli.pack.schema.header import LayoutRecord
from tests.helpers import pack_header
from tests.mutants import Parts

DATA = Path(__file__).parent / "data"
HEADER = pack_header(layout=LayoutRecord(next_position=20, position_dims=3))


def stored_dtype(path: Path, name: str) -> str:
    with open(path, "rb") as fh:
        return read_directory(fh, path)[0][name]["dtype"]


def fixture_segment(name, counts, base, dims=1, granularity=None, step=0):
    """Integer-valued floats, so the expected tensors are the same on every machine and torch
    version."""

    def grid(n, shift):
        return (
            torch.arange(2 * n * 8, dtype=torch.float32).reshape(2, n, 8) + base * 100 + shift
        ) / 4

    return Span(
        name=name,
        keys=[grid(n, 10 * layer) for layer, n in enumerate(counts)],
        values=[-grid(n, 10 * layer) for layer, n in enumerate(counts)],
        positions=[(torch.arange(n) + base).expand(dims, -1).clone() for n in counts],
        granularity=granularity,
        steps=(step, step + 1) if granularity else None,
        time=(float(step), float(step) + 0.5) if granularity else None,
        representative=torch.arange(16, dtype=torch.float32) + base if granularity else None,
    )


def fixture():
    blocks = [
        fixture_segment("b0", [3, 2, 1], 1, 3, "frame", 0),
        fixture_segment("b1", [4, 4, 0], 2, 3, "patch", 1),
    ]
    return (
        fixture_segment("prefix", [5, 5, 5], 0, 3),
        blocks,
        fixture_segment("suffix", [1, 1, 1], 9, 3),
    )


def assert_reads_back(reader, rep_layers=1):
    prefix, blocks, suffix = fixture()
    for original in (prefix, suffix, *blocks):
        loaded = reader.span(original.name)
        for part in ("keys", "values", "positions"):
            for a, b in zip(getattr(original, part), getattr(loaded, part)):
                assert torch.equal(a, b), (original.name, part)
    keys, values, positions = reader.gather(["b1", "b0"])
    for layer in range(3):
        assert torch.equal(
            keys[layer], torch.cat([blocks[1].keys[layer], blocks[0].keys[layer]], dim=1)
        )
        assert torch.equal(
            positions[layer],
            torch.cat([blocks[1].positions[layer], blocks[0].positions[layer]], dim=1),
        )
    reps = reader.representatives()  # [blocks, layers stored, dim]; v2-v5 stored one layer's
    assert reps.shape[1] == rep_layers
    assert torch.equal(reps[:, 0], torch.stack([b.representative.reshape(-1) for b in blocks]))
    assert [reader.blocks.kinds[c] for c in reader.blocks.codes()] == [
        "frame",
        "patch",
    ] and reader.blocks[1]["time"] == [1.0, 1.5]


def test_a_v3_pack_reads_back_exactly():
    reader = PackReader(DATA / "v3.kvpack")
    assert reader.format_version == 3
    assert_reads_back(reader)
    assert reader.rotated_representatives  # before v6 they were means of keys after RoPE


def test_a_v6_pack_reads_back_exactly():
    reader = PackReader(DATA / "v6.kvpack")
    assert reader.format_version == 6
    assert reader.quant is None  # int64 positions per layer, K/V as computed
    assert_reads_back(reader)
    assert not reader.rotated_representatives


def test_a_v7_pack_reads_back_exactly():
    reader = PackReader(DATA / "v7.kvpack")
    assert reader.format_version == 7
    assert stored_dtype(DATA / "v7.kvpack", "blocks.table") == "I64"  # v7: int64 always
    assert_reads_back(reader)
    assert not reader.rotated_representatives


def _per_block_round_trip(keys, group, bits=4):
    """Keys [H, n, D] of one layer of one block through the v7/v8 key groups: runs of `group`
    tokens of that block alone, a float16 scale and zero per channel, q = round((x - low) / s)."""
    out = []
    for first in range(0, keys.shape[1], group):
        run = keys[:, first : first + group]
        low, high = run.amin(dim=1, keepdim=True), run.amax(dim=1, keepdim=True)
        scale = ((high - low) / ((1 << bits) - 1)).half().float()
        zero = low.half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        out.append(((run - zero) / safe).round().clamp(0, (1 << bits) - 1) * scale + zero)
    return torch.cat(out, dim=1) if out else keys


def test_a_quantized_v8_pack_decodes_its_per_block_key_groups():
    """tests/data/v8q.kvpack: `fixture()` written 4-bit with key groups of 2 tokens by the v8
    writer (each block's layer runs grouped on their own; v9 lets groups run across blocks)."""
    reader = PackReader(DATA / "v8q.kvpack")
    assert reader.format_version == 8 and reader.quant.bits == 4 and not reader.quant.span
    _, blocks, _ = fixture()
    keys, _, positions = reader.gather(["b1", "b0"])
    for layer in range(3):
        want = torch.cat([_per_block_round_trip(blocks[i].keys[layer], 2) for i in (1, 0)], dim=1)
        assert torch.equal(keys[layer], want), layer
        assert torch.equal(
            positions[layer],
            torch.cat([blocks[1].positions[layer], blocks[0].positions[layer]], dim=1),
        )
    assert PackReader(DATA / "v8q.kvpack").block_faults() == []


def test_v9_packs_with_sha256_checksums_read_back_and_verify():
    """v10 made every checksum BLAKE3: a v9 pack's sha256 ones are still checked, and caught."""
    plain = PackReader(DATA / "v9.kvpack")
    assert plain.format_version == 9 and plain.digest == "sha256" and plain.quant is None
    assert_reads_back(plain)
    quantized = PackReader(DATA / "v9q.kvpack")
    assert quantized.quant.bits == 4 and quantized.quant.span and quantized.block_faults() == []
    keys, _, _ = quantized.gather(["b0", "b1"])
    _, blocks, _ = fixture()
    assert (keys[0] - torch.cat([b.keys[0] for b in blocks], dim=1)).abs().max() < 0.5
    for name in ("v9.kvpack", "v9q.kvpack"):
        assert api.verify(DATA / name)["ok"], name


def test_a_flipped_byte_in_a_v9_block_fails_its_sha256(tmp_path):
    parts = Parts.of((DATA / "v9.kvpack").read_bytes())
    start, _ = parts.directory["blocks.v"]["data_offsets"]
    parts.data[start + 1] ^= 0x40
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    with pytest.raises(PackError, match="checksum mismatch in b0"):
        PackReader(bad).gather(["b0"])
    assert not api.verify(bad)["ok"]


def test_the_table_and_step_lengths_are_int32_where_every_value_fits(tmp_path):
    prefix, blocks, suffix = fixture()
    steps = [196] * 1800
    series = {"layout.step_lengths": steps, "media.timestamps": [i / 2 for i in range(1800)]}
    write_pack(tmp_path / "now.kvpack", HEADER, prefix, blocks, suffix, series=series)
    reader = PackReader(tmp_path / "now.kvpack")
    for name in ("blocks.table", "layout.step_lengths"):
        assert stored_dtype(tmp_path / "now.kvpack", name) == "I32"
    assert reader.series("layout.step_lengths") == steps
    assert reader.blocks.rows().dtype == np.int64  # widened before any sum can overflow
    assert_reads_back(reader)


def test_values_past_int32_keep_int64():
    wide = torch.tensor([0, 2**31], dtype=torch.int64)
    assert narrowed(wide).dtype == torch.int64
    assert narrowed(torch.tensor([-(2**31), 2**31 - 1])).dtype == torch.int32
    assert torch.equal(narrowed(torch.tensor([5, 7])), torch.tensor([5, 7], dtype=torch.int32))


def test_the_current_writer_reads_back_the_same_segments(tmp_path):
    prefix, blocks, suffix = fixture()
    write_pack(tmp_path / "now.kvpack", HEADER, prefix, blocks, suffix)
    reader = PackReader(tmp_path / "now.kvpack")
    assert reader.format_version == FORMAT_VERSION
    assert_reads_back(reader)
    assert not reader.rotated_representatives


def test_a_series_the_pack_never_stored_is_one_clear_error():
    import pytest

    from mmkv_cli.core.errors import PackError

    with pytest.raises(
        PackError, match="stores no media.timestamps"
    ):  # the v3 fixture has no media section
        PackReader(DATA / "v3.kvpack").series("media.timestamps")


def test_an_older_header_is_upgraded_on_read_its_kv_shape_read_off_its_tensors():
    from typer.testing import CliRunner

    from mmkv_cli.api import inspect
    from mmkv_cli.cli.app import app
    from mmkv_cli.pack.schema.header import KVShape

    for version in (3, 6, 7):  # v3 and v6 headers do not say the KV's heads, width or dtype
        reader = PackReader(DATA / f"v{version}.kvpack")
        assert reader.format_version == version == reader.header.format_version
        assert reader.header.kv == KVShape(layers=3, kv_heads=2, head_dim=8, dtype="float32")
        assert reader.header.fingerprint.model == "m" and reader.header.method.in_code == "full"
        info = inspect(DATA / f"v{version}.kvpack")
        assert info["format_version"] == version and info["kv_bytes_per_token_as_computed"] == 128
        assert info["layers"] == [
            {"index": 0, "tokens_kept": 7},
            {"index": 1, "tokens_kept": 6},
            {"index": 2, "tokens_kept": 1},
        ]
        shown = CliRunner().invoke(app, ["inspect", str(DATA / f"v{version}.kvpack")])
        assert shown.exit_code == 0 and f"kvpack v{version}" in shown.output


def _resealed(name: str, edit) -> bytes:
    """Fixture `name` with its header edited by `edit(header)`, the header checksum recomputed."""
    from tests.mutants import Parts

    parts = Parts.of((DATA / name).read_bytes())
    header = parts.header()
    edit(header)
    parts.set_header(header)
    return parts.bytes()


def _refused(tmp_path, raw: bytes, match: str = "corrupted") -> None:
    import pytest

    from mmkv_cli import api
    from mmkv_cli.core.errors import PackError

    path = tmp_path / "forged.kvpack"
    path.write_bytes(raw)
    for look in (api.inspect, api.verify):
        with pytest.raises(PackError, match=match):
            look(path)


def test_older_packs_get_the_same_shape_checks_on_open(tmp_path):
    """Issue 40, items 4 and 7: counts or a version that the tensors do not bear out."""

    def prefix_counts(counts):
        return lambda h: h["spans"]["prefix"].update(layer_counts=counts)

    for counts in ([5, 5, 4], [5, 5, 5, 5], [6, 5, 5], [2**40, 0, 0]):
        _refused(tmp_path, _resealed("v6.kvpack", prefix_counts(counts)))
    for version in (3, 4, 5, 6):  # a v7 pack relabelled: int32 shared positions, 7 columns
        _refused(tmp_path, _resealed("v7.kvpack", lambda h, v=version: h.update(format_version=v)))
    _refused(tmp_path, _resealed("v6.kvpack", lambda h: h.update(format_version=3)))


def test_every_bit_of_a_v6_table_is_refused_or_harmless(tmp_path):
    """Issue 40, item 5: v6 has no digest over its table; a flipped bit there must fail the
    table's own checks on open, or leave every count and offset as they were."""
    from tests.mutants import Parts

    raw = (DATA / "v6.kvpack").read_bytes()
    parts = Parts.of(raw)
    start, stop = parts.directory["blocks.table"]["data_offsets"]
    original = np.frombuffer(bytes(parts.data[start:stop]), np.int64).reshape(2, 7)
    path = tmp_path / "flipped.kvpack"
    for bit in range((stop - start) * 8):
        flipped = Parts.of(raw)
        flipped.data[start + bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(flipped.bytes())
        try:
            reader = PackReader(path)
        except Exception as err:  # noqa: BLE001 (only a clear refusal is allowed)
            assert type(err).__name__ == "PackError", err
            continue
        changed = np.argwhere(reader.blocks.rows() != original)[:, 1]
        assert set(changed.tolist()) <= {0, 1, 2}, bit  # a label or steps: no size read from it


def test_verify_says_what_an_older_format_cannot_check(tmp_path):
    """Issue 40, item 6: v6 representatives carry no checksum; verify says so, not a bare ok."""
    from mmkv_cli import api

    report = api.verify(DATA / "v6.kvpack")
    assert report["ok"] and "representatives" in report["unverifiable"]
    assert "the block table" in report["unverifiable"]
    assert api.verify(DATA / "v7.kvpack")["unverifiable"] == []
