"""Recorded attention on the CPU's fused kernels (attention.py routes here).

H2O and MEDA need, for every row of every prefill chunk, how much attention each cached key got:
the column sums of softmax(QK^T * scale) over the rows. Written out, that is a [heads, rows, keys]
block through memory per chunk, several passes over it, and a second matmul for the output:
several times plain SDPA (docs/measurements.md). Here instead:

1. flash attention gives the output and each row's log-sum-exp (lse). The cached keys before the
   chunk are seen by every row, so they take one unmasked pass with a KV head's query heads stacked
   as rows (the cache is never copied per query head); the chunk's own keys take a causal pass; the
   two merge by their lse.
2. A cached key's column sum is sum_rows exp(s - lse_row): the log-sum-exp of the key *asking* the
   rows with a bias of -lse on each. So a second flash pass with the roles swapped returns, as its
   lse, the log of every cached key's column sum. The chunk's own keys (causal, a small share) are
   summed from explicit blocks.

Everything runs in float32, as the block path does, and matches it to float rounding.
"""

from __future__ import annotations

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.recorder import Recorder, reducer_columns

BLOCK_ELEMENTS = 1 << 22  # explicit score blocks (own keys, reducers' columns): about 16 MB


def _flash(query, key, value, **kwargs):
    """(output, lse) of the CPU flash kernel: the public SDPA does not return the lse."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, **kwargs)


def lse_attention(query, key, value, scaling: float):
    """Causal attention with the queries last: (output [B, H, q, D], lse [B, H, q]), float32.

    query [B, H, q, D]; key, value [B, H_kv, k, D] with k >= q (the first k - q are cached context).
    """
    batch, heads, n, dim = query.shape
    kv_heads, past = key.shape[1], key.shape[2] - n
    group = heads // kv_heads
    q, k, v = query.float(), key.float(), value.float()
    own_k, own_v = (t[:, :, past:].repeat_interleave(group, dim=1) for t in (k, v))
    out, lse = _flash(q, own_k, own_v, is_causal=True, scale=scaling)
    if past:
        stacked = q.reshape(batch, kv_heads, group * n, dim)
        out_past, lse_past = _flash(stacked, k[:, :, :past], v[:, :, :past], scale=scaling)
        out_past = out_past.reshape(batch, heads, n, -1)
        lse_past = lse_past.reshape(batch, heads, n)
        total = torch.logaddexp(lse, lse_past)
        out = out * (lse - total).exp()[..., None] + out_past * (lse_past - total).exp()[..., None]
        lse = total
    return out, lse


def probability_blocks(query, key, lse, scaling: float, columns: slice, stride: int = 1):
    """exp(QK^T * scale - lse) for the keys in `columns` (causal, queries last), a block of rows at
    a time: yields (first row, probs [B, H, rows, columns]). Each row's lse normalises it over all
    keys, so these are the true attention probabilities of those columns. stride: every Nth row
    only (first row and rows then count the sampled rows)."""
    kv_heads, k_len = key.shape[1], key.shape[2]
    past = k_len - query.shape[2]
    query, lse = query[:, :, ::stride], lse[:, :, ::stride]
    batch, heads, n, dim = query.shape
    group = heads // kv_heads
    first, stop, _ = columns.indices(k_len)
    keys_t = key[:, :, first:stop].float().transpose(-1, -2).unsqueeze(2)  # [B, H_kv, 1, D, c]
    keys_at = torch.arange(first, stop)
    width = max(1, stop - first)
    step = max(1, BLOCK_ELEMENTS // (batch * heads * width))
    for start in range(0, n, step):
        rows = query[:, :, start : start + step].float() * scaling
        count = rows.shape[2]
        scores = (rows.reshape(batch, kv_heads, group, count, dim) @ keys_t).reshape(
            batch, heads, count, -1
        )
        probs = scores.sub_(lse[:, :, start : start + count, None]).exp_()
        row_at = torch.arange(start, start + count) * stride + past
        yield start, probs.masked_fill_(keys_at[None, :] > row_at[:, None], 0.0)


def column_sums(query, key, lse, scaling: float, stride: int = 1, per_head: bool = False):
    """Sum over the query rows of the head-mean attention each key receives -> [B, k]; per_head:
    of each KV head's query-head mean -> [B, H_kv, k]. stride N: over every Nth row only, times N
    (an estimate, for a cheaper second pass)."""
    batch, heads, n, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group, past = heads // kv_heads, k_len - n
    # on the device: read by the policy
    sums = torch.zeros(batch, kv_heads, k_len, device=query.device)
    if past:
        rows, row_lse = query[:, :, ::stride], lse[:, :, ::stride]
        stacked = rows.float().reshape(batch, kv_heads, -1, dim)
        bias = (-row_lse).reshape(batch, kv_heads, 1, -1)
        cached = key[:, :, :past].float().contiguous()
        # the swapped pass's output is not wanted; the stacked rows serve as its values
        _, swapped = _flash(cached, stacked, stacked, attn_mask=bias, scale=scaling)
        sums[:, :, :past] = swapped.exp()  # a KV head's query heads' rows summed
    own = slice(past, k_len)
    for _, probs in probability_blocks(query, key, lse, scaling, own, stride):
        grouped = probs.reshape(batch, kv_heads, group, *probs.shape[2:])
        sums[:, :, past:] += grouped.sum(dim=(2, 3))
    if per_head:
        return sums * (stride / group)
    return sums.sum(dim=1) * (stride / heads)


def recorded(recorder: Recorder, layer: int, query, key, value, scaling: float):
    """The layer's output [B, q, H, D], recording column sums and reducers as asked."""
    out, lse = lse_attention(query, key, value, scaling)
    if recorder.column_sums:
        recorder.column_sum[layer] = column_sums(
            query, key, lse, scaling, recorder.row_stride, recorder.per_head
        )
    if recorder.reducers:
        totals = recorder.reduced.setdefault(layer, {})
        for name, (columns, fn) in recorder.reducers.items():
            at = reducer_columns(columns, layer)
            for _, probs in probability_blocks(query, key, lse, scaling, at):
                got = fn(probs)
                totals[name] = totals[name] + got if name in totals else got
    return out.to(query.dtype).transpose(1, 2).contiguous()
