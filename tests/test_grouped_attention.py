"""A question's few query rows attend to the whole context under a mask. transformers' SDPA would
copy every cached key and value once per query head of a group (repeat_kv); grouped_sdpa folds
the group's heads into the query rows instead: the same attention, no copy of the context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.integrations import sdpa_attention

from mmkv_cli.kernels import attention
from mmkv_cli.kernels.attention import grouped_sdpa, own_length_mask, with_heads


@pytest.fixture
def copies(monkeypatch):
    """transformers' SDPA as an installed model has it, its repeat_kv calls counted."""
    monkeypatch.setattr(attention, "_sdpa", sdpa_attention.sdpa_attention_forward)
    seen, real = [], sdpa_attention.repeat_kv

    def counted(hidden, n_rep):
        seen.append(n_rep)
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)
    return seen


def tensors(heads: int, kv_heads: int, rows: int, keys: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, heads, 16, generator=g).to(dtype).transpose(1, 2)  # a view
    key = torch.randn(1, kv_heads, keys, 16, generator=g).to(dtype)
    value = torch.randn(1, kv_heads, keys, 16, generator=g).to(dtype)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, query, key, value


def written_out(query, key, value, visible) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V with every KV head repeated for its query heads -> [B, q, H, D]."""
    group = query.shape[1] // key.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (key, value))
    scores = (query.float() @ k.transpose(-1, -2)) * query.shape[-1] ** -0.5
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,rows,keys", [(14, 2, 13, 700), (28, 4, 9, 300)])
def test_a_questions_rows_attend_the_context_without_copying_it(
    copies, dtype, heads, kv_heads, rows, keys
):
    module, query, key, value = tensors(heads, kv_heads, rows, keys, dtype)
    mask = own_length_mask(query, key, None)  # causal, the question's rows last
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=16**-0.5, dropout=0.0)
    assert copies == []
    copied, _ = sdpa_attention.sdpa_attention_forward(
        module, query, key, value, mask, scaling=16**-0.5, dropout=0.0
    )
    assert copies == [heads // kv_heads] * 2  # what the fold saves: K and V copied
    assert got.shape == copied.shape == (1, rows, heads, 16)
    assert torch.equal(got, copied)  # each row's arithmetic is the same
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), written_out(query, key, value, mask), atol=tolerance)


def test_a_mask_per_query_head_is_folded_with_its_rows(copies):
    """An ask over a cache held per head: each KV head sees only its own entries."""
    module, query, key, value = tensors(8, 2, 5, 40, seed=1)
    held = torch.ones(2, 35, dtype=torch.bool)
    held[0, :10] = False  # KV head 0 holds entries 10.. of the context, head 1 all of them
    causal = own_length_mask(query, key, None)
    mask = with_heads(query, key, causal, held)  # [1, H, q, k]
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=16**-0.5)
    assert copies == []
    assert torch.allclose(got, written_out(query, key, value, mask), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 200])
def test_one_row_and_a_chunks_rows_stay_with_transformers(copies, rows, monkeypatch):
    """One row: transformers folds it itself; past FOLD_ROWS (an encode's chunk) the folded mask
    would outgrow the copy it saves."""
    monkeypatch.setattr(attention, "FOLD_ROWS", 7 * 100)
    module, query, key, value = tensors(14, 2, rows, 300)
    mask = (torch.arange(300)[None] <= torch.arange(rows)[:, None] + 300 - rows)[None, None]
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=16**-0.5)
    assert copies == ([] if rows == 1 else [7, 7])
    assert torch.allclose(got, written_out(query, key, value, mask), atol=1e-5)
