"""What a forward should keep of its attention, and what it kept: the request a memory policy
hands the recording attention function (attention.py, fused_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmkv_cli.core.lazy import torch


@dataclass
class Recorder:
    """What to keep from which layers during one or more forwards (a batch may hold several
    blocks)."""

    layers: set[int]
    column_sums: bool = False
    queries: bool = False
    rows: bool = False
    # name -> (key columns, fn(block [B, H, rows, columns] attention of every head) -> tensor),
    # summed over a layer's rows: a reducer reads only its own columns (MEDA: the prompt), not
    # whole rows. The columns are one slice, or a slice per layer ({layer: slice}).
    reducers: dict = field(default_factory=dict)
    # column sums from every Nth query row only, times N: an estimate that spares most of the second
    # pass over QK^T on the fused path (1: every row, exact)
    row_stride: int = 1
    # column sums per KV head ([B, H_kv, kv_len], each the mean over its query heads) instead of
    # over all heads: what a method that keeps tokens per head scores by
    per_head: bool = False
    # what was recorded, per layer: column sums [B, kv_len] (per_head: [B, H_kv, kv_len]) and
    # rows [B, q_len, kv_len] (float32), reducer totals by name, queries [B, H, q_len, D]
    column_sum: dict[int, torch.Tensor] = field(default_factory=dict)
    reduced: dict[int, dict] = field(default_factory=dict)
    row: dict[int, torch.Tensor] = field(default_factory=dict)
    query: dict[int, torch.Tensor] = field(default_factory=dict)


def reducer_columns(columns: slice | dict[int, slice], layer: int) -> slice:
    """The key columns a reducer reads in `layer`: its one slice, or that layer's own."""
    return columns[layer] if isinstance(columns, dict) else columns
