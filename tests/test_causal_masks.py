"""On CUDA an attention that `_attention` declares causal runs flash attention with no mask at all
(grouped_sdpa): every query row sees the keys up to its own place, the queries the newest. That
holds only because mmkv never runs the language model padded, and no family adds to the causal
pattern. Here every mask so declared, in encodes and asks of every family, is checked to be
exactly that, so a change that breaks it (a padded batch, a family's own mask) fails on the CPU."""

from __future__ import annotations

import pytest
import torch

from mmkv_cli.kernels import attention
from mmkv_cli.options import MethodSpec
from tests.conftest import TINY
from tests.helpers import ask_pack, encode_pack


@pytest.fixture
def declared(monkeypatch):
    """Every (rows, keys, the mask as given) that grouped_sdpa is told is causal."""
    seen, real = [], attention.grouped_sdpa

    def watched(module, query, key, value, mask, causal=False, **kwargs):
        if causal:  # the model's mask, for layer 0's length: the layer's own made from it
            seen.append((query.shape[2], key.shape[2], attention.own_length_mask(query, key, mask)))
        return real(module, query, key, value, mask, causal, **kwargs)

    monkeypatch.setattr(attention, "grouped_sdpa", watched)
    return seen


def newest_last(rows: int, keys: int) -> torch.Tensor:
    return torch.arange(keys)[None] <= torch.arange(rows)[:, None] + (keys - rows)


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("method,budget", [("full", None), ("hermes", 0.3), ("rekv", None)])
def test_every_mask_declared_causal_is_causal_alone(
    backbones, clip, tmp_path, declared, model, method, budget
):
    """full: chunks over a growing cache; hermes: a cache evicted under a budget; rekv: blocks
    spliced into each layer while the question runs."""
    pack = tmp_path / "clip.kvpack"
    backbone = backbones[model]
    choice = MethodSpec(method, {"chunk_frames": 4})
    encode_pack(clip, pack, method=choice, budget=budget, backbone=backbone, max_frames=16)
    ask_pack(pack, "What happens?", backbone=backbone, max_new_tokens=2)
    chunks = {(rows, keys) for rows, keys, mask in declared if 1 < rows < keys and mask is not None}
    assert len(chunks) >= 3, "chunks over a cache, and a question"
    for rows, keys, mask in declared:
        if mask is None:  # SDPA's own causal flag: rows == keys, or one row seeing all
            assert rows in (1, keys)
            continue
        visible = mask if mask.dtype == torch.bool else mask == 0
        assert visible.shape[-2:] == (rows, keys)
        assert torch.equal(visible, newest_last(rows, keys).expand_as(visible)), (rows, keys)
