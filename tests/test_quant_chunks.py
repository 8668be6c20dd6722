"""The host (de)quantizes a chunk of tokens at a time (quant.CHUNK_TOKENS, 2,048: a 7B frame's
28 layers are 5,488 token rows): across every chunk edge the codes, scales and decoded values
equal those of the whole block at once, and codes sit in their bytes lowest bits first."""

import pytest
import torch

from mmkv_cli.pack.quantized import quant
from mmkv_cli.pack.quantized.quant import (
    dequantize,
    pack_codes,
    quantize_keys_with,
    quantize_values,
)


def test_codes_sit_in_their_byte_lowest_bits_first():
    codes = torch.tensor([[1, 2, 3, 0, 3, 1, 0, 2]], dtype=torch.uint8)
    assert pack_codes(codes, 4).tolist() == [[0x21, 0x03, 0x13, 0x20]]
    assert pack_codes(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4, 3 | 1 << 2 | 2 << 6]]
    assert pack_codes(codes & 1, 1).tolist() == [[1 | 1 << 2 | 1 << 4 | 1 << 5]]
    assert torch.equal(codes, torch.tensor([[1, 2, 3, 0, 3, 1, 0, 2]], dtype=torch.uint8))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_chunk_at_a_time_gives_the_whole_blocks_codes_and_values(bits, monkeypatch):
    g = torch.Generator().manual_seed(bits)
    n, heads, dim, group = 50, 2, 16, 16
    keys = (torch.randn(n, heads, dim, generator=g) * 3).half()
    values = (torch.randn(n, heads, dim, generator=g) * 3).half()
    groups = -(-n // group)
    scales = torch.stack(
        [torch.rand(groups, heads, dim, generator=g) / 8, -torch.rand(groups, heads, dim) * 2], 1
    ).half()
    scales[1, 0, 0, :4] = 0  # constant channels: a zero scale
    rows = torch.arange(n) // group

    def coded():
        packed = quantize_keys_with(keys, scales, rows, bits)
        packed_values, value_scales = quantize_values(values, bits, group)
        decoded = dequantize(packed, packed_values, scales, rows, value_scales, bits, torch.float16)
        return packed, packed_values, value_scales, *decoded

    monkeypatch.setattr(quant, "CHUNK_TOKENS", 1 << 20)
    whole = coded()
    monkeypatch.setattr(quant, "CHUNK_TOKENS", 7)
    assert len(quant.token_chunks(n, keys.device)) == 8  # 7 full chunks and a short one
    chunked = coded()
    for a, b in zip(whole, chunked):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the values' own ranges: each decodes within half a step of its group's scale
    half_step = whole[2][..., 0].float().repeat_interleave(group, dim=-1).reshape(n, heads, dim) / 2
    assert ((whole[4].float() - values.float()).abs() <= half_step + 1e-2).all()
    assert whole[1].shape == (n, heads, dim * bits // 8) and whole[2].shape == (n, 2, 2)
