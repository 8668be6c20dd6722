"""1.5-bit KV after VidKV: the frequency-domain signs, the 2-bit half, ternary values, on tensors
written from the definitions (pack/quantized/vidkv.py); then a pack stored at 1.5 bits and read
back."""

import pytest
import torch

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import kv_bits_value
from mmkv_cli.pack import PackReader, Span, write_pack
from mmkv_cli.pack.quantized import vidkv as V
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import FORMAT_VERSION
from tests.helpers import pack_header


def test_the_real_fft_of_e_values_is_e_real_numbers_and_comes_back():
    x = torch.randn(3, 2, 8)
    parts = V.real_components(x)
    assert parts.shape == x.shape
    spectrum = torch.fft.rfft(x, dim=-1)  # bins 0..4; bins 0 and 4 are real
    assert torch.allclose(parts[..., :5], spectrum.real) and torch.allclose(
        parts[..., 5:], spectrum.imag[..., 1:4]
    )
    assert torch.allclose(V.from_components(parts), x, atol=1e-5)


def test_the_widest_half_of_the_channels_gets_two_bits():
    keys = torch.randn(6, 2, 8) * 0.1
    keys[:, :, [1, 4, 6, 7]] *= 50  # the four widest channels, over all heads and tokens
    values = torch.randn(6, 2, 8)
    planes = V.group_planes(keys, values).float()
    assert planes[2, 0].tolist() == [0, 1, 0, 0, 1, 0, 1, 1] == planes[2, 1].tolist()
    hard = keys[:, :, [1, 4, 6, 7]]
    low, high = hard.amin(dim=0), hard.amax(dim=0)
    assert torch.allclose(planes[1][:, [1, 4, 6, 7]], low.half().float())
    assert torch.allclose(planes[0][:, [1, 4, 6, 7]], ((high - low) / 3).half().float())
    easy = V.real_components(keys[:, :, [0, 2, 3, 5]]).abs().mean(dim=0)
    assert torch.allclose(planes[0][:, [0, 2, 3, 5]], easy.half().float(), rtol=1e-3)
    # the values' mean magnitude per channel over the group's tokens
    assert torch.allclose(planes[3], values.abs().mean(dim=0).half().float())


def test_keys_on_the_grid_of_their_codes_decode_exactly():
    # the 2-bit channels take only their group's four levels; the easy channels' FFT components
    # are +-their scale: both decode exactly, through 3 bytes a head of 16 channels
    torch.manual_seed(3)
    n, heads, dim = 12, 2, 16
    hard = [0, 1, 2, 3, 4, 5, 6, 7]
    keys = torch.zeros(n, heads, dim)
    levels = torch.randint(0, 4, (n, heads, 8)).float()
    levels[0], levels[1] = 0, 3  # the group's range is exactly 3 steps of 8
    keys[:, :, hard] = levels * 8.0 - 4.0
    magnitude = torch.tensor([0.5, 0.25, 0.75, 0.5, 1.0, 0.25, 0.5, 0.75])
    signs = torch.randint(0, 2, (n, heads, 8)).float() * 2 - 1
    keys[:, :, 8:] = V.from_components(signs * magnitude)
    planes = V.group_planes(keys, torch.ones(n, heads, dim))
    assert planes[2, :, :8].eq(1).all() and planes[2, :, 8:].eq(0).all()
    per_token = planes[None].expand(n, -1, -1, -1)
    codes = V.encode_keys(keys, per_token)
    assert codes.shape == (n, heads, V.key_width(dim)) == (n, heads, 3)
    assert torch.allclose(V.decode_keys(codes, per_token), keys, atol=1e-3)


def test_values_are_ternary_per_channel_against_half_their_mean_magnitude_over_the_group():
    # four tokens, one head, two channels: channel 0's mean |x| is 1, channel 1's is 0.2
    values = torch.tensor([[2.0, 0.06], [-0.4, -0.3], [0.6, 0.09], [-1.0, 0.35]]).unsqueeze(1)
    planes = V.group_planes(torch.randn(4, 1, 2), values)[None].expand(4, -1, -1, -1)
    codes = V.encode_values(values, planes)
    assert codes.shape == (4, 1, 1)  # two trits in a byte
    mean = values.abs().mean(dim=0).half().float()
    q = (values > mean / 2).float() - (values < -mean / 2).float()
    assert q[:, 0].tolist() == [[1, 0], [0, -1], [1, 0], [-1, 1]]
    assert torch.allclose(V.decode_values(codes, planes), q * mean)


def test_kv_bits_takes_the_offered_values_only():
    assert kv_bits_value("1.5") == 1.5 and kv_bits_value(8.0) == 8 and kv_bits_value("16") == 16
    assert type(kv_bits_value(4.0)) is int
    for bad in ("3", "1.58", "nan", "x", True):
        with pytest.raises(UsageError, match="--kv-bits must be one of"):
            kv_bits_value(bad)


def test_a_pack_at_one_and_a_half_bits_reads_back_what_the_definitions_decode(tmp_path):
    g = torch.Generator().manual_seed(5)
    counts = [10, 10]

    def span(name, n, granularity=None):
        return Span(
            name=name,
            keys=[torch.randn(2, n, 16, generator=g) * 3 for _ in counts],
            values=[torch.randn(2, n, 16, generator=g) for _ in counts],
            positions=[torch.arange(n).unsqueeze(0)] * 2,
            granularity=granularity,
            steps=(0, 1) if granularity else None,
            time=(0.0, 0.5) if granularity else None,
        )

    block = span("b0", 10, "frame")
    path = tmp_path / "v.kvpack"
    write_pack(
        path,
        pack_header(layers=2, dim=16),
        span("prefix", 2),
        [block],
        span("suffix", 1),
        False,
        QuantSpec(1.5, 32),
    )
    reader = PackReader(path)
    assert reader.quant.bits == 1.5 and reader.header.format_version == FORMAT_VERSION
    keys, values, _ = reader.gather(["b0"])
    for layer in range(2):
        # token-major [n, H, D]; one group a layer: 10 < 32 tokens
        k, v = (part[layer].transpose(0, 1) for part in (block.keys, block.values))
        planes = V.group_planes(k, v)[None].expand(10, -1, -1, -1)
        want = V.decode_keys(V.encode_keys(k, planes), planes).transpose(0, 1)
        assert torch.allclose(keys[layer], want, atol=1e-6)
        want_v = V.decode_values(V.encode_values(v, planes), planes).transpose(0, 1)
        assert torch.allclose(values[layer], want_v, atol=1e-6)
    assert reader.block_faults() == []


def test_forged_channel_flags_are_refused_even_when_resealed(tmp_path):
    """A forger who rewrites a group's 2-bit flags and re-seals every digest still meets one clear
    error: each flag must be 0 or 1, and half of a head's channels 2-bit."""
    import numpy as np

    from mmkv_cli.core.errors import PackError
    from mmkv_cli.pack.integrity.hashing import chunk_digests
    from tests.mutants import Parts

    g = torch.Generator().manual_seed(9)
    n = 12
    span = Span(
        "b0",
        [torch.randn(2, n, 16, generator=g) for _ in range(2)],
        [torch.randn(2, n, 16, generator=g) for _ in range(2)],
        [torch.arange(n).unsqueeze(0)] * 2,
        "frame",
        (0, 1),
        (0.0, 0.5),
    )
    prompt = Span("prefix", span.keys, span.values, span.positions)
    path = tmp_path / "v.kvpack"
    header = pack_header(layers=2, dim=16)
    write_pack(path, header, prompt, [span], replace_name(prompt, "suffix"), False, QuantSpec(1.5))
    for flag in (0.5, 0.0):
        parts = Parts.of(path.read_bytes())
        start, stop = parts.directory["blocks.kq"]["data_offsets"]
        planes = (
            np.frombuffer(bytes(parts.data[start:stop]), np.float16).reshape(-1, 4, 2, 16).copy()
        )
        first_hard = int(np.flatnonzero(planes[0, 2, 0] == 1)[0])
        planes[0, 2, 0, first_hard] = flag  # not a flag, or one 2-bit channel too few
        parts.data[start:stop] = planes.tobytes()
        stored = parts.header()
        digest = stored["integrity"]["key_scales"]
        digest["blake3"] = chunk_digests(planes.tobytes(), digest["chunk"], "blake3")
        parts.set_header(stored)
        parts.reseal()
        forged = tmp_path / "forged.kvpack"
        forged.write_bytes(parts.bytes())
        with pytest.raises(PackError, match="channel flags"):
            PackReader(forged).gather(["b0"])
        assert "channel flags" in PackReader(forged).block_faults()[0]


def replace_name(span: Span, name: str) -> Span:
    from dataclasses import replace

    return replace(span, name=name)
