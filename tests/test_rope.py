"""Delta rotation and position compaction: a key rotated from p to q is the key the model computes
at q."""

import pytest
import torch

from mmkv_cli.kernels.rope import compact_positions, rotate_keys
from tests.conftest import TINY


@pytest.mark.parametrize("name", TINY)
def test_rotated_key_equals_key_computed_at_new_position(backbones, name):
    backbone = backbones[name]
    token = backbone.embed_ids([7])
    dims = backbone.position_dims
    at_p = torch.tensor([[40], [43], [45]])[:dims]
    at_q = torch.tensor([[3], [9], [4]])[:dims]  # a different change on every M-RoPE axis
    keys = []
    for pos in (at_p, at_q):
        cache = backbone.new_cache()
        backbone.forward(token, pos, cache)
        keys.append([layer.keys[0] for layer in cache.layers])
    inv_freq, axes = backbone.rope_tables()
    for k_p, k_q in zip(*keys):
        moved = rotate_keys(k_p, at_q - at_p, inv_freq, axes)
        assert (moved - k_q).abs().max().item() < 1e-4
        assert (k_p - k_q).abs().max().item() > 1e-2  # the positions really differ


def test_compact_positions_1d_closes_gaps():
    pos = torch.tensor([[5, 6, 9, 30, 31]])
    assert compact_positions(pos, 2).tolist() == [[2, 3, 4, 5, 6]]


def test_compact_positions_keeps_grids_and_puts_text_after_them():
    # two 2x2 grids at temporal 10 and 25 (spatial offsets up to +1), then one text token at 40
    def grid(t):
        return [[t] * 4, [t, t, t + 1, t + 1], [t, t + 1, t, t + 1]]

    pos = torch.tensor([a + b + [40] for a, b in zip(grid(10), grid(25))])
    out = compact_positions(pos, 3)
    assert out[:, :4].tolist() == grid(3)
    assert out[:, 4:8].tolist() == grid(4)  # the next frame takes the next temporal slot
    assert out[:, 8].tolist() == [6, 6, 6]  # text starts after the largest position used
