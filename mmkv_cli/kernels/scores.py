"""Attention's probabilities as the methods score by them, never a heads x n x n map of a whole
sequence: softmax(QK^T/sqrt(d)) a block of query rows at a time (its size bounded by
SCORE_ELEMENTS), the column sums and rows a `Recorder` asks for, and the layer's output computed
from the same probabilities (on the CPU the fused kernels of fused_attention.py instead)."""

from __future__ import annotations

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels import fused_attention as fused
from mmkv_cli.kernels.recorder import Recorder, reducer_columns

QUERY_ROWS_PER_STEP = 256  # rows of QK^T computed at once when scoring: bounds peak memory
SCORE_ELEMENTS = 1 << 27  # and fewer rows when the keys are many: a block stays near 512 MB


def _row_blocks(query: torch.Tensor, key: torch.Tensor, scaling: float):
    """softmax(QK^T * scaling) per head, causal with the queries last, a block of query rows at a
    time (as many as keep a block near SCORE_ELEMENTS): yields (first row, probs [B, H, rows, k]).

    query [B, H, q, D], key [B, H_kv, k, D] (k >= q: earlier keys are cached context). Query heads
    sharing a KV head are grouped against it, so the keys are never copied per query head.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    keys_t = key.float().transpose(-1, -2).unsqueeze(2)  # [B, H_kv, 1, D, k]
    keys_at = torch.arange(k_len, device=query.device)
    step = max(1, min(QUERY_ROWS_PER_STEP, SCORE_ELEMENTS // max(1, batch * heads * k_len)))
    for start in range(0, q_len, step):
        rows = query[:, :, start : start + step].float()
        n = rows.shape[2]
        scores = rows.reshape(batch, kv_heads, group, n, dim) @ keys_t * scaling
        row_at = torch.arange(start, start + n, device=query.device) + (k_len - q_len)
        scores = scores.masked_fill(keys_at[None, :] > row_at[:, None], float("-inf"))
        yield start, scores.softmax(dim=-1).reshape(batch, heads, n, k_len)


def causal_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Sum over query rows of the head-mean attention each key receives -> [B, k]."""
    sums = torch.zeros(query.shape[0], key.shape[2], dtype=torch.float32, device=query.device)
    for _, probs in _row_blocks(query, key, scaling):
        sums += probs.mean(dim=1).sum(dim=1)
    return sums


def causal_rows(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Every query row's head-mean attention over the keys -> [B, q, k] (for a few rows: a
    question)."""
    return torch.cat([probs.mean(dim=1) for _, probs in _row_blocks(query, key, scaling)], dim=1)


def recorded_attention(recorder: Recorder, layer: int, query, key, value, scaling: float):
    """The layer's output [B, q, H, D] and, into the recorder, what it asks for: on fused kernels on
    the CPU (whole rows excepted: they are a question's few rows), else block by block."""
    if query.device.type == "cpu" and not recorder.rows:
        return fused.recorded(recorder, layer, query, key, value, scaling)
    return _blockwise_recorded(recorder, layer, query, key, value, scaling)


def _blockwise_recorded(recorder: Recorder, layer: int, query, key, value, scaling: float):
    """Attention computed here, block by block, from the same probabilities that are recorded:
    recording all rows (H2O, MEDA) then costs no second pass over QK^T. Returns [B, q, H, D]."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    values = value.float().unsqueeze(2)  # [B, H_kv, 1, k, D]
    out = torch.empty(batch, heads, q_len, value.shape[-1], dtype=query.dtype, device=query.device)
    sums, rows, totals = (
        None,
        [],
        recorder.reduced.setdefault(layer, {}) if recorder.reducers else {},
    )
    for start, probs in _row_blocks(query, key, scaling):
        n = probs.shape[2]
        grouped = probs.reshape(batch, kv_heads, heads // kv_heads, n, -1)
        out[:, :, start : start + n] = (grouped @ values).reshape(batch, heads, n, -1).to(out.dtype)
        mean = probs.mean(dim=1)  # [B, rows, k]
        if recorder.column_sums:
            stride = recorder.row_stride
            scored = grouped.mean(dim=2) if recorder.per_head else mean  # [B, (H_kv,) rows, k]
            sampled = scored[..., (-start) % stride :: stride, :].sum(dim=-2) * stride
            sums = sampled if sums is None else sums + sampled
        if recorder.rows:
            rows.append(mean)
        for name, (columns, fn) in recorder.reducers.items():
            got = fn(probs[..., reducer_columns(columns, layer)])
            totals[name] = totals[name] + got if name in totals else got
    if recorder.column_sums:
        recorder.column_sum[layer] = sums
    if recorder.rows:
        recorder.row[layer] = torch.cat(rows, dim=1)
    return out.transpose(1, 2).contiguous()
