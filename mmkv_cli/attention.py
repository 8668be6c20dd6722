"""Attention scores without eager attention maps.

The language model runs on SDPA through an attention function registered as "mmkv". While a
`Recorder` is active, that function also keeps, for the layers asked for, what a method needs: the
post-RoPE queries, or the column sums of softmax(QK^T/sqrt(d)) over the query rows — computed a few
query rows at a time, so memory never holds heads x n x n for the whole sequence.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field

from mmkv_cli.lazy import torch

NAME = "mmkv"
QUERY_ROWS_PER_STEP = 256  # rows of QK^T computed at once when scoring: bounds peak memory

_sdpa = None  # transformers' SDPA attention, bound by install() (importing it costs seconds)
_active: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "mmkv_recorder", default=None
)


@dataclass
class Recorder:
    """What to keep from which layers during one or more forwards (a batch may hold several
    blocks)."""

    layers: set[int]
    column_sums: bool = False
    queries: bool = False
    rows: bool = False
    # name -> fn(block [B, rows, kv_len] head-mean attention) -> tensor; summed over row blocks per
    # layer
    reducers: dict = field(default_factory=dict)
    column_sum: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # layer -> [B, kv_len] float32
    reduced: dict[int, dict] = field(default_factory=dict)  # layer -> name -> summed reducer output
    row: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # layer -> [B, q_len, kv_len] float32
    query: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, H, q_len, D]


def _row_blocks(query: torch.Tensor, key: torch.Tensor, scaling: float):
    """Head-mean softmax(QK^T * scaling) rows, causal with the queries last, QUERY_ROWS_PER_STEP at
    a time.

    query [B, H, q, D], key [B, H_kv, k, D] (k >= q: earlier keys are cached context) -> yields [B,
    rows, k].
    """
    q_len, k_len = query.shape[2], key.shape[2]
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1).float()
    keys_at = torch.arange(k_len, device=query.device)
    for start in range(0, q_len, QUERY_ROWS_PER_STEP):
        rows = query[:, :, start : start + QUERY_ROWS_PER_STEP].float()
        scores = rows @ key.transpose(-1, -2) * scaling
        row_at = torch.arange(start, start + rows.shape[2], device=query.device) + (k_len - q_len)
        scores = scores.masked_fill(keys_at[None, :] > row_at[:, None], float("-inf"))
        yield scores.softmax(dim=-1).mean(dim=1)


def causal_column_sums(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Sum over query rows of the head-mean attention each key receives -> [B, k]."""
    sums = torch.zeros(query.shape[0], key.shape[2], dtype=torch.float32, device=query.device)
    for block in _row_blocks(query, key, scaling):
        sums += block.sum(dim=1)
    return sums


def causal_rows(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Every query row's head-mean attention over the keys -> [B, q, k] (for a few rows: a
    question)."""
    return torch.cat(list(_row_blocks(query, key, scaling)), dim=1)


def _attention(module, query, key, value, attention_mask, **kwargs):
    recorder = _active.get()
    layer = module.layer_idx
    if recorder is not None and layer in recorder.layers:
        if recorder.queries:
            recorder.query[layer] = query.detach()
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        if recorder.column_sums:
            recorder.column_sum[layer] = causal_column_sums(query.detach(), key.detach(), scaling)
        if recorder.rows:
            recorder.row[layer] = causal_rows(query.detach(), key.detach(), scaling)
        if recorder.reducers:
            totals = recorder.reduced.setdefault(layer, {})
            for block in _row_blocks(query.detach(), key.detach(), scaling):
                for name, fn in recorder.reducers.items():
                    out = fn(block)
                    totals[name] = totals[name] + out if name in totals else out
    return _sdpa(module, query, key, value, own_length_mask(query, key, attention_mask), **kwargs)


def own_length_mask(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The causal mask for this layer's own key length.

    The model builds one mask from layer 0's cache length; a compressed cache may hold a different
    number of keys in each layer (the queries are always the newest entries), so such a layer gets
    its own mask.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    if (mask is None and (q_len == 1 or q_len == k_len)) or (
        mask is not None and mask.shape[-1] == k_len
    ):
        return mask
    rows = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
    return (torch.arange(k_len, device=query.device)[None, :] <= rows)[None, None]


def install(model) -> None:
    """Route the language model's attention (not the vision tower's) through the recording
    function."""
    global _sdpa
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa = sdpa_attention_forward
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.config.get_text_config()._attn_implementation = NAME


@contextmanager
def recording(recorder: Recorder):
    token = _active.set(recorder)
    try:
        yield recorder
    finally:
        _active.reset(token)
