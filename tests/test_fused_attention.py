"""The CPU's fused recording path (flash attention with the roles swapped for column sums) against
the block-by-block path CUDA takes: same output, same column sums, same reducers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmkv_cli.kernels import attention, fused_attention, scores
from mmkv_cli.kernels.attention import Recorder, recording


def _reference(query, key, value):
    """Attention and every head's probabilities written out in full: [B, q, H, D], [B, H, q, k]."""
    group = query.shape[1] // key.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scores = query @ k.transpose(-1, -2) * query.shape[-1] ** -0.5
    rows, keys = query.shape[2], key.shape[2]
    visible = torch.arange(keys)[None, :] <= torch.arange(rows)[:, None] + (keys - rows)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = scores.softmax(dim=-1)
    return (probs @ v).transpose(1, 2), probs


@pytest.mark.parametrize(
    "batch,heads,kv_heads,rows,keys",
    [(1, 4, 2, 7, 30), (2, 6, 2, 5, 5), (1, 14, 2, 40, 300), (2, 4, 4, 9, 12)],
)
def test_fused_recording_equals_the_written_out_attention(batch, heads, kv_heads, rows, keys):
    _check_fused(batch, heads, kv_heads, rows, keys)


@pytest.mark.parametrize("rows_a_block", [1, 3, 7])
def test_fused_recording_in_score_blocks_of_a_few_rows(monkeypatch, rows_a_block):
    """At 7B a chunk's explicit score blocks (its own keys, a reducer's columns) hold about 95 of
    its 1,568 rows each (BLOCK_ELEMENTS over 28 heads x 1,568 keys); a test's chunk fits in one.
    Lowered here so each pass crosses several block edges, the last one short."""
    monkeypatch.setattr(fused_attention, "BLOCK_ELEMENTS", 2 * 14 * 40 * rows_a_block)
    _check_fused(1, 14, 2, 40, 300)  # own keys: 40 wide, 14 heads, a batch of 1
    monkeypatch.setattr(fused_attention, "BLOCK_ELEMENTS", 2 * 4 * 6 * rows_a_block)
    _check_fused(2, 4, 2, 9, 30)  # the prompt's 6 columns, 4 heads, a batch of 2


def _check_fused(batch, heads, kv_heads, rows, keys):
    torch.manual_seed(rows + keys)
    query = torch.randn(batch, heads, rows, 16) * 2  # sharp rows: small probabilities matter
    key, value = torch.randn(batch, kv_heads, keys, 16), torch.randn(batch, kv_heads, keys, 16)
    prompt = slice(0, min(6, keys))  # a reducer's columns, reaching into the rows' own keys
    # a reducer sees every head: the mass each head's rows put on the prompt columns [B, H]
    reducer = {"mass": (prompt, lambda block: block.sum(dim=(2, 3)))}
    expected_out, per_head = _reference(query, key, value)
    expected_probs = per_head.mean(dim=1)

    fused = Recorder(layers={0}, column_sums=True, reducers=reducer)
    blockwise = Recorder(layers={0}, column_sums=True, reducers=reducer)
    out = fused_attention.recorded(fused, 0, query, key, value, 16**-0.5)
    out_blocks = scores._blockwise_recorded(blockwise, 0, query, key, value, 16**-0.5)

    assert torch.allclose(out, expected_out, atol=1e-5)
    assert torch.allclose(out_blocks, expected_out, atol=1e-5)
    sums = expected_probs.sum(dim=1)
    assert torch.allclose(fused.column_sum[0], sums, atol=1e-5, rtol=1e-4)
    assert torch.allclose(blockwise.column_sum[0], sums, atol=1e-5, rtol=1e-4)
    # every row is a distribution: the column sums add up to the number of rows
    assert torch.allclose(fused.column_sum[0].sum(dim=-1), torch.full((batch,), float(rows)))
    mass = per_head[..., prompt].sum(dim=(2, 3))
    assert torch.allclose(fused.reduced[0]["mass"], mass, atol=1e-5)
    assert torch.allclose(blockwise.reduced[0]["mass"], mass, atol=1e-5)


def test_the_attention_function_takes_the_fused_path_on_the_cpu_and_keeps_the_dtype():
    torch.manual_seed(3)
    query = torch.randn(1, 4, 6, 8, dtype=torch.bfloat16)
    key = torch.randn(1, 2, 20, 8, dtype=torch.bfloat16)
    value = torch.randn(1, 2, 20, 8, dtype=torch.bfloat16)
    recorder = Recorder(layers={0}, column_sums=True)
    with recording(recorder):
        out, _ = attention._attention(SimpleNamespace(layer_idx=0), query, key, value, None)
    expected, per_head = _reference(query.float(), key.float(), value.float())
    probs = per_head.mean(dim=1)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, atol=2e-2)
    assert torch.allclose(recorder.column_sum[0], probs.sum(dim=1), atol=1e-4)


def test_column_sums_of_a_large_chunk_do_not_write_out_the_score_block(monkeypatch):
    """The cached keys' sums come from the swapped flash pass: the explicit blocks only ever cover
    the chunk's own keys (a chunk of 64 rows against 4,096 cached keys here)."""
    seen = []
    original = fused_attention.probability_blocks

    def spy(query, key, lse, scaling, columns, stride=1):
        seen.append(columns.indices(key.shape[2]))
        yield from original(query, key, lse, scaling, columns, stride)

    monkeypatch.setattr(fused_attention, "probability_blocks", spy)
    query, key = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 4096 + 64, 8)
    _, lse = fused_attention.lse_attention(query, key, key, 8**-0.5)
    sums = fused_attention.column_sums(query, key, lse, 8**-0.5)
    assert seen == [(4096, 4096 + 64, 1)]
    assert torch.allclose(sums.sum(), torch.tensor(64.0), atol=1e-3)


@pytest.mark.parametrize("stride,rows,keys", [(3, 40, 300), (4, 7, 7), (2, 9, 50)])
def test_a_row_stride_sums_every_nth_row_times_n_on_both_paths(stride, rows, keys, monkeypatch):
    """The cheaper estimate: both paths sum exactly the sampled rows (every Nth of the chunk,
    counted from its first) and scale by N, so they agree with each other and with the written-out
    attention of those rows, whatever the block size."""
    torch.manual_seed(stride * rows)
    query = torch.randn(2, 4, rows, 16) * 2
    key, value = torch.randn(2, 2, keys, 16), torch.randn(2, 2, keys, 16)
    probs = _reference(query, key, value)[1].mean(dim=1)
    expected = probs[:, ::stride].sum(dim=1) * stride

    fused = Recorder(layers={0}, column_sums=True, row_stride=stride)
    blockwise = Recorder(layers={0}, column_sums=True, row_stride=stride)
    fused_attention.recorded(fused, 0, query, key, value, 16**-0.5)
    monkeypatch.setattr(scores, "QUERY_ROWS_PER_STEP", 5)  # blocks start off the sampled rows
    scores._blockwise_recorded(blockwise, 0, query, key, value, 16**-0.5)
    assert torch.allclose(fused.column_sum[0], expected, atol=1e-5, rtol=1e-4)
    assert torch.allclose(blockwise.column_sum[0], expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(expected, probs.sum(dim=1), atol=1e-3)  # a sample, not all rows


@pytest.mark.parametrize("keys,rows_a_step", [(300, 3), (150, 6), (90, 10)])
def test_score_blocks_take_fewer_rows_as_the_keys_grow(keys, rows_a_step, monkeypatch):
    """At 7B over an hour (28 heads x 350K keys) one block of QUERY_ROWS_PER_STEP rows would be
    10 GB of float32 scores: SCORE_ELEMENTS takes a step down to 13 rows there. Lowered here so
    that 300 keys give 3 rows a step (and fewer keys more): the recorded output, column sums and
    rows equal the written-out attention across every block edge."""
    monkeypatch.setattr(scores, "SCORE_ELEMENTS", 2 * 4 * 900)
    steps, real = [], scores._row_blocks

    def counted(query, key, scaling):
        for start, probs in real(query, key, scaling):
            steps.append(probs.shape[2])
            yield start, probs

    monkeypatch.setattr(scores, "_row_blocks", counted)
    torch.manual_seed(keys)
    query = torch.randn(2, 4, 20, 16) * 2
    key, value = torch.randn(2, 2, keys, 16), torch.randn(2, 2, keys, 16)
    out, probs = _reference(query, key, value)
    recorder = Recorder(layers={0}, column_sums=True, rows=True)
    got = scores._blockwise_recorded(recorder, 0, query, key, value, 16**-0.5)
    assert steps == [min(rows_a_step, 20 - first) for first in range(0, 20, rows_a_step)]
    assert torch.allclose(got, out, atol=1e-5)
    assert torch.allclose(recorder.column_sum[0], probs.mean(dim=1).sum(dim=1), atol=1e-5)
    assert torch.allclose(recorder.row[0], probs.mean(dim=1), atol=1e-6)


def test_a_cuda_model_attends_without_cudnns_per_shape_plans():
    """cuDNN's SDPA builds a plan for each new (query, key) length; on CUDA it is switched off and
    flash and memory-efficient attention stay on. A CPU model leaves torch's switches alone."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention.plan_free_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        attention.plan_free_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
