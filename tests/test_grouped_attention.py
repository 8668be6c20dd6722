"""Query rows attend to a cached context under a mask. transformers' SDPA would copy every cached
key and value once per query head of a group (repeat_kv); grouped_sdpa reads the grouped heads as
they are: a question's few rows with the group's heads folded into them, an encode's chunk on the
CPU by SDPA's grouped heads, and on CUDA flash attention aligned to the last key where the mask is
causal alone. The same attention, no copy of the context."""

from __future__ import annotations

import warnings
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
def test_one_row_stays_with_transformers_and_a_chunks_rows_read_grouped_heads(
    copies, rows, monkeypatch
):
    """One row: transformers folds it itself. Past FOLD_ROWS (an encode's chunk) the folded mask
    would outgrow the copy it saves: on the CPU, SDPA takes the mask with grouped heads, and
    gives transformers' output (to the bit on torch 2.14)."""
    monkeypatch.setattr(attention, "FOLD_ROWS", 7 * 100)
    module, query, key, value = tensors(14, 2, rows, 300)
    mask = (torch.arange(300)[None] <= torch.arange(rows)[:, None] + 300 - rows)[None, None]
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=16**-0.5)
    assert copies == []
    copied, _ = sdpa_attention.sdpa_attention_forward(
        module, query, key, value, mask, scaling=16**-0.5
    )
    assert torch.allclose(got, copied, rtol=0, atol=1e-6)
    assert torch.allclose(got, written_out(query, key, value, mask), atol=1e-5)


@pytest.fixture
def flash_everywhere(monkeypatch):
    """The flash path taken on the CPU too (torch then lays the causal bias out as a mask; on
    CUDA it is flash's own causal flag): what the bias means is checked here, not the kernel."""
    monkeypatch.setattr(attention, "_flash_lower_right", lambda *_: True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch says which kernels it could not use on the CPU
        yield


@pytest.mark.parametrize("heads,kv_heads,rows,keys", [(14, 2, 120, 300), (4, 4, 33, 33)])
def test_a_causal_chunk_on_flash_sees_the_keys_up_to_its_own_place(
    copies, flash_everywhere, heads, kv_heads, rows, keys
):
    """causal: the mask hides from each row only the keys after it, so flash needs none. A
    chunk's rows are the newest keys: aligned to the first keys instead, row 0 would see one
    key, and this fails."""
    module, query, key, value = tensors(heads, kv_heads, rows, keys, seed=2)
    causal = own_length_mask(query, key, None)
    causal = causal if causal is not None else torch.ones(rows, keys, dtype=torch.bool).tril()
    everything = torch.ones(1, 1, rows, keys, dtype=torch.bool)  # not read: causal says it all
    got, _ = grouped_sdpa(module, query, key, value, everything, causal=True, scaling=16**-0.5)
    assert copies == []
    assert torch.allclose(got, written_out(query, key, value, causal), atol=1e-5)


def test_a_mask_not_declared_causal_is_read_on_the_flash_path_too(copies, flash_everywhere):
    """A cache held per head (an ask's `with_heads` mask) is more than causal: its mask is read."""
    module, query, key, value = tensors(8, 2, 5, 40, seed=3)
    held = torch.ones(2, 35, dtype=torch.bool)
    held[1, 5:20] = False
    mask = with_heads(query, key, own_length_mask(query, key, None), held)
    got, _ = grouped_sdpa(module, query, key, value, mask, scaling=16**-0.5)
    assert torch.allclose(got, written_out(query, key, value, mask), atol=1e-5)


def test_flash_is_asked_for_on_cuda_alone():
    _, query, key, value = tensors(14, 2, 8, 40, torch.bfloat16)
    assert not attention._flash_lower_right(query, key, value)


def test_on_flash_no_mask_is_made_for_the_layers_own_length(copies, flash_everywhere, monkeypatch):
    """A chunk's rows over an hour's keys: its mask would be a GB. On flash none is made."""

    def made(*_):
        raise AssertionError("a mask was made")

    monkeypatch.setattr(attention, "own_length_mask", made)
    module, query, key, value = tensors(14, 2, 120, 300, seed=4)
    got, _ = grouped_sdpa(module, query, key, value, None, causal=True, scaling=16**-0.5)
    causal = torch.arange(300)[None] <= torch.arange(120)[:, None] + 180
    assert torch.allclose(got, written_out(query, key, value, causal), atol=1e-5)


def test_a_chunk_over_a_cache_held_per_head_attends_each_heads_own_keys_gathered():
    """Past FOLD_ROWS rows (a chunk), each KV head's queries attend to the cached entries it holds
    and to the chunk's own keys, causally: the written-out masked attention, without building the
    [heads, rows, keys] mask a chunk's rows over an InfiniPot-V cache would need."""
    module, query, key, value = tensors(heads=8, kv_heads=2, rows=300, keys=700)
    n = 400  # cached entries; the last 300 keys are the chunk's own
    held = torch.rand(2, n, generator=torch.Generator().manual_seed(4)) > 0.5
    got, _ = attention.held_keys_only(module, query, key, value, held)
    causal = own_length_mask(query, key, None)
    visible = with_heads(query, key, causal, held)
    torch.testing.assert_close(
        got.float(), written_out(query, key, value, visible), atol=1e-5, rtol=1e-4
    )
    masks = {0: held}
    with attention.masking(masks):  # the layer's attention takes this path for a chunk's rows
        via, _ = attention._attention(
            SimpleNamespace(layer_idx=0, num_key_value_groups=4, is_causal=True),
            query, key, value, None,
        )  # fmt: skip
    torch.testing.assert_close(via, got)
