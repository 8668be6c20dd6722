"""Quantized KV: the scoring-free maths on tensors, then packs written quantized and read back."""

import dataclasses
from pathlib import Path

import pytest
import torch

from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.quantized.quant import (
    QuantSpec,
    SpanningKeyRanges,
    dequantize_keys,
    dequantize_values,
    layer_first_groups,
    pack_codes,
    quantize_keys_with,
    quantize_values,
    spanning_groups,
    unpack_codes,
)
from tests.helpers import pack_header


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_codes_pack_and_unpack_exactly(bits):
    codes = torch.randint(0, 1 << bits, (5, 2, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 2, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)


def key_groups(counts, group):
    """One block alone: its layers' runs, each cut into groups of its own."""
    return spanning_groups([0] * len(counts), counts, group, layer_first_groups(counts, group))


def quantize_keys(keys, counts, bits, group):
    """One block's keys quantized as a pack of that block alone stores them."""
    ranges = SpanningKeyRanges(counts, group, bits, keys.shape[1], keys.shape[2])
    ranges.add(keys, counts)
    scales = ranges.finish()
    return quantize_keys_with(keys, scales, key_groups(counts, group), bits), scales


def test_key_groups_restart_at_every_layer_run():
    # layers keep 5, 0 and 3 tokens; groups of 2 tokens
    assert key_groups([5, 0, 3], 2).tolist() == [0, 0, 1, 1, 2, 3, 3, 4]


def test_key_groups_run_on_across_blocks_layer_by_layer():
    # three blocks keep (3, 1), (2, 0), (4, 3) tokens in layers 0 and 1; groups of 4 tokens:
    # layer 0's 9 tokens make groups 0, 1, 2; layer 1's 4 tokens group 3
    firsts = layer_first_groups([9, 4], 4)
    assert firsts == [0, 3]
    assert spanning_groups([0, 0], [3, 1], 4, firsts).tolist() == [0, 0, 0, 3]
    assert spanning_groups([3, 1], [2, 0], 4, firsts).tolist() == [0, 1]
    assert spanning_groups([5, 1], [4, 3], 4, firsts).tolist() == [1, 1, 1, 2, 3, 3, 3]


def test_spanning_ranges_are_each_groups_own_min_and_max_across_blocks():
    # the keys of two blocks; each group's scale must come from exactly its own tokens
    torch.manual_seed(1)
    blocks = [(torch.randn(5, 1, 6), [3, 2]), (torch.randn(7, 1, 6), [4, 3])]
    ranges = SpanningKeyRanges([7, 5], 2, 8, 1, 6)
    for keys, counts in blocks:
        ranges.add(keys, counts)
    assert ranges.closed == [3, 2]  # the last group of each layer is still open
    scales = ranges.finish().float()  # [groups, 2 (scale, zero), 1, 6]
    # layer 0: tokens 3 + 4 = 7 -> groups 0..3; layer 1: 2 + 3 = 5 -> groups 4..6
    layer0 = torch.cat([blocks[0][0][:3], blocks[1][0][:4]])[:, 0]
    layer1 = torch.cat([blocks[0][0][3:], blocks[1][0][4:]])[:, 0]
    runs = [layer0[i : i + 2] for i in range(0, 7, 2)] + [layer1[i : i + 2] for i in range(0, 5, 2)]
    assert scales.shape[0] == len(runs) == 7
    for g, run in enumerate(runs):
        low, high = run.amin(0), run.amax(0)
        assert torch.allclose(scales[g, 1, 0], low.half().float())
        assert torch.allclose(scales[g, 0, 0], ((high - low) / 255).half().float())


def _expanded(scales, counts, group):
    return scales[key_groups(counts, group)]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_round_trip_error_is_at_most_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    counts = [70, 33]
    keys = torch.randn(sum(counts), 2, 64, generator=g) * 3
    values = torch.randn(sum(counts), 2, 64, generator=g)
    codes, scales = quantize_keys(keys, counts, bits, 64)
    assert codes.shape == (103, 2, 64 * bits // 8) and scales.shape == (2 + 1, 2, 2, 64)
    back = dequantize_keys(codes, _expanded(scales, counts, 64).float(), bits)
    step = _expanded(scales, counts, 64)[:, 0].float()
    assert ((back - keys).abs() <= step / 2 + 1e-2 * step + 1e-6).all()
    codes, scales = quantize_values(values, bits, 64)
    assert scales.shape == (103, 2, 2)  # per token, one group per 64 channels
    back = dequantize_values(codes, scales.float(), bits)
    step = scales[..., 0].float().repeat_interleave(64, dim=1).reshape(103, 2, 64)
    assert ((back - values).abs() <= step / 2 + 1e-2 * step + 1e-6).all()


def test_a_layers_outlier_does_not_widen_another_layers_scale():
    keys = torch.randn(8, 1, 8)
    quiet = dequantize_keys(*_round(keys, [4, 4]))
    keys[0, 0, 0] = 1000.0  # layer 0's first token
    loud = dequantize_keys(*_round(keys, [4, 4]))
    assert torch.equal(quiet[4:], loud[4:])  # layer 1's keys decode as before


def _round(keys, counts, bits=4, group=64):
    codes, scales = quantize_keys(keys, counts, bits, group)
    return codes, _expanded(scales, counts, group).float(), bits


def test_constant_channels_decode_exactly():
    keys = torch.full((6, 2, 8), 0.5)
    assert torch.equal(dequantize_keys(*_round(keys, [6])), keys)


def test_settings_the_width_cannot_take_are_refused():
    QuantSpec(4, 64).check(2, 64)
    QuantSpec(2, 256).check(2, 64)  # a value group wider than a token: the whole token
    with pytest.raises(UsageError, match="does not divide"):
        QuantSpec(4, 48).check(2, 64)
    with pytest.raises(UsageError, match="--kv-bits"):
        QuantSpec(3, 64).check(2, 64)
    with pytest.raises(UsageError, match="float16"):
        quantize_values(torch.full((1, 1, 8), 1e6), 4, 8)


def span(name, counts, seed, granularity=None, shared=True):
    g = torch.Generator().manual_seed(seed)
    return Span(
        name=name,
        keys=[torch.randn(2, n, 16, generator=g) for n in counts],
        values=[torch.randn(2, n, 16, generator=g) for n in counts],
        positions=[
            (torch.arange(n) + (0 if shared else layer)).expand(3, -1).clone()
            for layer, n in enumerate(counts)
        ],
        granularity=granularity,
        steps=(seed, seed + 1) if granularity else None,
        time=(float(seed), float(seed) + 0.5) if granularity else None,
        representative=torch.randn(1, 32, generator=g) if granularity else None,
    )


HEADER = pack_header(dim=16)


def write(path, quant=None):
    blocks = [
        span("b0", [20, 20, 20], 1, "frame"),
        span("b1", [9, 4, 0], 2, "patch"),
        span("b2", [5, 5, 5], 3, "frame", shared=False),
    ]
    write_pack(
        path, HEADER, span("prefix", [3] * 3, 0), blocks, span("suffix", [1] * 3, 9), False, quant
    )
    return blocks


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_quantized_pack_reads_back_its_dequantized_kv(tmp_path, bits, monkeypatch):
    monkeypatch.setattr(
        "mmkv_cli.pack.quantized.quant.CHUNK_TOKENS", 7
    )  # chunks cut blocks and layers
    blocks = write(tmp_path / "q.kvpack", QuantSpec(bits, 8))
    reader = PackReader(tmp_path / "q.kvpack")
    assert reader.quant == QuantSpec(bits, 8)
    names = ["b2", "b0", "b1"]
    keys, values, positions = reader.gather(names)
    for layer in range(3):
        want_keys, want_values = [], []
        # the layer's keys of every block in table order, cut into groups of 8 tokens together
        run = torch.cat([b.keys[layer] for b in blocks], dim=1)  # [H, tokens, D]
        decoded = torch.cat(
            [_round_trip(run[:, i : i + 8], bits) for i in range(0, run.shape[1], 8)], dim=1
        )
        starts = [sum(b.layer_counts[layer] for b in blocks[:i]) for i in range(len(blocks))]
        for name in names:
            index = int(name[1:])
            block = blocks[index]
            counts = block.layer_counts
            n = counts[layer]
            want_keys.append(decoded[:, starts[index] : starts[index] + n])
            value_codes, value_scales = quantize_values(block.part(1), bits, 8)
            v = dequantize_values(value_codes, value_scales.float(), bits)
            first = sum(counts[:layer])
            want_values.append(v[first : first + n].transpose(0, 1))
        assert torch.equal(keys[layer], torch.cat(want_keys, dim=1))
        assert torch.equal(values[layer], torch.cat(want_values, dim=1))
        want = torch.cat([blocks[int(n[1:])].positions[layer] for n in names], dim=1)
        assert torch.equal(positions[layer], want) and positions[layer].dtype == torch.int64
    # the prefix stays exact (as computed)
    assert torch.equal(reader.span("prefix").keys[1], span("prefix", [3] * 3, 0).keys[1])


def _round_trip(keys, bits):
    """Keys [H, n, D] of one group through a per-channel float16 scale and zero and back, as the
    definition reads: q = round((x - low) / scale), x' = q * scale + low."""
    low, high = keys.amin(dim=1, keepdim=True), keys.amax(dim=1, keepdim=True)
    scale = ((high - low) / ((1 << bits) - 1)).half().float()
    zero = low.half().float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((keys - zero) / safe).round().clamp(0, (1 << bits) - 1)
    return codes * scale + zero


def test_per_layer_gathers_read_each_layers_blocks(tmp_path):
    write(tmp_path / "q.kvpack", QuantSpec(4, 8))
    reader = PackReader(tmp_path / "q.kvpack")
    whole = reader.gather(["b0", "b2"])
    keys, _, positions = reader.gather(["b0", "b2"], [["b0", "b2"], ["b2"], ["b0"]])
    assert torch.equal(keys[0], whole[0][0])
    assert torch.equal(keys[1], whole[0][1][:, 20:]) and torch.equal(keys[2], whole[0][2][:, :20])
    assert torch.equal(positions[1], whole[2][1][:, 20:])


def test_positions_are_int32_and_stored_once_when_layers_agree(tmp_path):
    write(tmp_path / "p.kvpack")
    reader = PackReader(tmp_path / "p.kvpack")
    entry = reader._entries["blocks.pos"]
    # b0 shares (20 rows), b1 differs by layer (13), b2's layers sit at other positions (15)
    assert entry["dtype"] == "I32" and entry["shape"] == [20 + 13 + 15, 3]
    assert reader._entries["prefix.pos"]["shape"] == [3, 3]


def flip(path, tensor: str, at: int, mask: int) -> PackReader:
    """Flip `mask` in byte `at` of `tensor`'s bytes in the pack at `path` (opened first)."""
    reader = PackReader(path)
    start = reader._tensors.data_start + reader._entries[tensor]["data_offsets"][0]
    with open(path, "r+b") as fh:
        fh.seek(start + at)
        byte = fh.read(1)
        fh.seek(start + at)
        fh.write(bytes([byte[0] ^ mask]))
    return reader


def test_the_spanning_key_scales_are_checksummed_apart_and_named_by_verify(tmp_path):
    path = tmp_path / "q.kvpack"
    write(path, QuantSpec(4, 8))
    reader = flip(path, "blocks.kq", 3, 0x01)
    assert "key_scales" in reader._stored["integrity"]
    with pytest.raises(PackError, match="checksum mismatch in the key scales"):
        PackReader(path).gather(["b1"])
    assert PackReader(path).block_faults() == ["key scales: checksum mismatch"]


@pytest.mark.parametrize("part", ["blocks.k", "blocks.vq", "blocks.pos"])
def test_every_stored_part_of_a_block_is_checksummed(tmp_path, part):
    path = tmp_path / "q.kvpack"
    write(path, QuantSpec(4, 8))
    flip(path, part, 1, 0x10)
    with pytest.raises(PackError, match="checksum mismatch in b0"):
        PackReader(path).gather(["b0"])


def test_quantized_packs_are_smaller_by_their_bits(tmp_path):
    sizes = {}
    for bits in (16, 8, 4, 2):
        path = tmp_path / f"{bits}.kvpack"
        g = torch.Generator().manual_seed(0)
        blocks = [
            Span(
                f"b{i}",
                [torch.randn(2, 196, 64, generator=g).half() for _ in range(2)],
                [torch.randn(2, 196, 64, generator=g).half() for _ in range(2)],
                [torch.arange(196).unsqueeze(0) + 196 * i] * 2,
                "frame",
                (i, i + 1),
                (i, i),
            )
            for i in range(16)
        ]
        tiny = Span(
            "prefix",
            [torch.zeros(2, 1, 64).half()] * 2,
            [torch.zeros(2, 1, 64).half()] * 2,
            [torch.zeros(1, 1, dtype=torch.int64)] * 2,
        )
        write_pack(
            path,
            HEADER,
            tiny,
            blocks,
            Span("suffix", tiny.keys, tiny.values, tiny.positions),
            False,
            QuantSpec(bits, 64),
        )
        sizes[bits] = path.stat().st_size
    # codes, an fp16 scale and zero per 64 values (0.5 bit a value; the keys' last group of 4
    # tokens in 196 costs as much as a full one) and the positions, once for both layers
    for bits in (8, 4, 2):
        key_bits, value_bits = bits + 4 * 32 / 196, bits + 32 / 64
        assert sizes[bits] / sizes[16] < ((key_bits + value_bits) / 2 + 0.1) / 16  # + positions


def test_a_forged_key_group_layout_is_refused_on_open(tmp_path):
    """A v9 pack relabelled as per-block groups (or a v8 one as spanning), its header re-sealed:
    the scales' shape or the header's own rule gives it away before any block is read."""
    from mmkv_cli import api
    from tests.mutants import Parts

    write(tmp_path / "q.kvpack", QuantSpec(4, 8))

    def forged(edit) -> Path:
        parts = Parts.of((tmp_path / "q.kvpack").read_bytes())
        header = parts.header()
        edit(header)
        parts.set_header(header)
        out = tmp_path / "forged.kvpack"
        out.write_bytes(parts.bytes())
        return out

    cases = [
        lambda h: h["quant"].pop("key_groups"),
        lambda h: h["quant"].update(key_groups="sideways"),
        lambda h: h.update(format_version=8),
        lambda h: h["integrity"]["key_scales"]["blake3"].append("0" * 64),
    ]
    for edit in cases:
        path = forged(edit)
        for look in (api.inspect, api.verify):
            with pytest.raises(PackError, match="corrupted"):
                look(path)


def test_a_context_decoding_past_its_dtype_is_refused_now_or_with_the_first_token(tmp_path):
    """Key scales finite as stored can still decode past float16's range (a forger's, re-sealed):
    a gather checks the decoded values; one for a question leaves that verdict unread, for the
    first token to read with itself (pack/integrity/verdicts.py), instead of a wait of its own."""
    import numpy as np

    from mmkv_cli.pack.integrity.hashing import chunk_digests
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts
    from mmkv_cli.pack.schema.format import digest_name
    from tests import mutants

    write(tmp_path / "q.kvpack", QuantSpec(4, 8))
    parts = mutants.Parts.of((tmp_path / "q.kvpack").read_bytes())
    start, stop = parts.directory["blocks.kq"]["data_offsets"]
    np.frombuffer(parts.data, np.float16, (stop - start) // 2, start)[:] = 30_000  # x 15: inf
    header = parts.header()
    algorithm, scales = digest_name(header["format_version"]), header["integrity"]["key_scales"]
    scales[algorithm] = chunk_digests(bytes(parts.data[start:stop]), scales["chunk"], algorithm)
    parts.set_header(header)
    parts.reseal()
    (tmp_path / "forged.kvpack").write_bytes(parts.bytes())
    reader = PackReader(tmp_path / "forged.kvpack")
    assert torch.isfinite(reader.gather(["b0"])[0][0]).all()  # float32 holds it
    with pytest.raises(PackError, match=r"corrupted \(NaN or Inf in the K/V of b0\)"):
        reader.gather(["b0"], dtype=torch.float16)
    later = LaterVerdicts(str(reader.path))
    keys = reader.gather(["b0"], dtype=torch.float16, later=later)[0]
    assert not torch.isfinite(keys[0]).all() and not bool(later.pending())
    fine = LaterVerdicts(str(reader.path))
    reader.gather(["b0"], later=fine)
    assert bool(fine.pending())
    write(tmp_path / "plain.kvpack")  # stored as computed: checked on the host, nothing left
    plain = LaterVerdicts("plain")
    PackReader(tmp_path / "plain.kvpack").gather(["b0", "b1"], later=plain)
    assert plain.pending() is None


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_scales_alone_say_whether_every_code_decodes_finite(bits, dtype):
    """verify decodes only the blocks whose scales might not decode finite: the verdict from the
    scales must be the one decoding every code gives, through dequantize itself, at the edges
    (float16's overflow from 65520, a tie rounding up), at NaN and Inf, and at random."""
    import numpy as np

    from mmkv_cli.pack.quantized.codes import pack_codes
    from mmkv_cli.pack.quantized.decodable import decodes_finite
    from mmkv_cli.pack.quantized.quant import dequantize_keys

    top = (1 << bits) - 1
    edges = [0.0, 1.0, -1.0, 65504.0, -65504.0, 1e-7, 30000.0, -30000.0]
    edges += [65520.0 / top, 65504.0 / top, -65520.0 / top, 65536.0 / (top + 1)]
    edges += [float("inf"), float("-inf"), float("nan")]
    g = torch.Generator().manual_seed(bits)
    values = torch.tensor(edges + (torch.randn(25, generator=g) * 9000).tolist()).half()
    scale, zero = (t.reshape(-1) for t in torch.meshgrid(values, values, indexing="ij"))
    pairs = scale.numel()  # 40 x 40, a multiple of 8: every code width packs it
    codes = torch.arange(top + 1, dtype=torch.uint8)[:, None, None].expand(-1, 1, pairs)
    scales = torch.stack([scale, zero])[None, :, None, :].expand(top + 1, -1, -1, -1)
    decoded = dequantize_keys(pack_codes(codes.contiguous(), bits), scales.float(), bits)
    exact = torch.isfinite(decoded.to(getattr(torch, dtype))).all(dim=0)[0]
    said = decodes_finite(scale.numpy(), zero.numpy(), bits, dtype)
    assert np.array_equal(said, exact.numpy())
    assert not said.all() and said.any()


def test_verify_decodes_only_the_blocks_whose_scales_might_overflow(tmp_path, monkeypatch):
    """A float16 pack at 4 bits: verify of an honest one decodes no block; one with a value scale
    forged past float16 (its block's checksum re-sealed) decodes that block alone and names it."""
    import numpy as np

    from mmkv_cli.pack.access import block_store
    from mmkv_cli.pack.access.report import verify
    from tests import mutants

    header = pack_header(dim=16, dtype="float16")
    blocks = [span(f"b{i}", [6, 4, 5], i + 1, "frame") for i in range(4)]
    halved = [dataclasses.replace(b, keys=[k.half() for k in b.keys],
                                  values=[v.half() for v in b.values]) for b in blocks]  # fmt: skip
    prefix, suffix = span("prefix", [3] * 3, 0), span("suffix", [1] * 3, 9)
    prefix, suffix = (
        dataclasses.replace(s, keys=[k.half() for k in s.keys], values=[v.half() for v in s.values])
        for s in (prefix, suffix)
    )
    path = tmp_path / "q.kvpack"
    write_pack(path, header, prefix, halved, suffix, False, QuantSpec(4, 8))
    decoded = []
    read_rows = block_store.BlockStore.read_rows
    monkeypatch.setattr(
        block_store.BlockStore,
        "read_rows",
        lambda self, where, *a: decoded.append(list(where.indices)) or read_rows(self, where, *a),
    )
    assert verify(path)["ok"] and decoded == []
    parts = mutants.Parts.of(path.read_bytes())
    start, _ = parts.directory["blocks.vq"]["data_offsets"]
    row = 6 + 4 + 5 + 3  # b1's fourth token
    width = parts.directory["blocks.vq"]["shape"][1] * 2 * 2  # its groups' (scale, zero), float16
    np.frombuffer(parts.data, np.float16, width // 2, start + row * width)[0::2] = 30_000
    mutants._reseal_block(parts, parts.header(), "blocks.vq", row)
    parts.reseal()
    bad = tmp_path / "bad.kvpack"
    bad.write_bytes(parts.bytes())
    assert verify(bad)["faults"] == ["block b1: NaN or Inf in its K/V"]
    assert decoded and all(blocks == [1] for blocks in decoded)  # b1 alone was decoded
    # the spanning key scales past float16 (their own digests re-sealed): every block's keys
    from mmkv_cli.pack.integrity.hashing import chunk_digests
    from mmkv_cli.pack.schema.format import digest_name

    parts = mutants.Parts.of(path.read_bytes())
    start, stop = parts.directory["blocks.kq"]["data_offsets"]
    np.frombuffer(parts.data, np.float16, (stop - start) // 2, start)[:] = 30_000
    header = parts.header()
    algorithm, scales = digest_name(header["format_version"]), header["integrity"]["key_scales"]
    scales[algorithm] = chunk_digests(bytes(parts.data[start:stop]), scales["chunk"], algorithm)
    parts.set_header(header)
    parts.reseal()
    bad.write_bytes(parts.bytes())
    assert verify(bad)["faults"] == [f"block b{i}: NaN or Inf in its K/V" for i in range(4)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("plane_axis,shape", [(-1, (300, 4, 2)), (1, (40, 2, 2, 8))])
def test_a_rows_scales_are_settled_by_their_bits_and_only_doubtful_rows_decoded(
    dtype, plane_axis, shape
):
    """verify's screen of a quantized pack's scales: per row, the verdict decodes_finite gives
    pair by pair, whether every row passes the one-pass screen (an honest pack) or some hold a
    scale past 2^(15 - bits), Inf or NaN."""
    import numpy as np

    from mmkv_cli.pack.quantized.decodable import decodes_finite, rows_decode_finite

    rng = np.random.default_rng(len(shape))
    pairs = (rng.standard_normal(shape) * 3).astype(np.float16)

    def by_pairs(rows):
        scale, zero = np.take(rows, 0, plane_axis), np.take(rows, 1, plane_axis)
        return decodes_finite(scale, zero, 4, dtype).reshape(len(rows), -1).all(axis=1)

    assert rows_decode_finite(pairs, plane_axis, 4, dtype).all()
    assert rows_decode_finite(pairs[:0], plane_axis, 4, dtype).shape == (0,)  # no rows
    flat = pairs.reshape(len(pairs), -1)
    for row, value in [(3, np.inf), (7, np.nan), (11, 3000.0), (12, 65504.0), (20, -5000.0)]:
        flat[row, row % flat.shape[1]] = value
    got = rows_decode_finite(pairs, plane_axis, 4, dtype)
    assert np.array_equal(got, by_pairs(pairs))
    assert not got[[3, 7]].any() and got[[0, 1, 2]].all()
    if dtype == "float16":  # past 2^11 a row is decoded: 65504 x 15 overflows float16
        assert not got[12] and got[11] == by_pairs(pairs[11:12])[0]
    else:
        assert got[[11, 12, 20]].all()
