"""Delta rotation of stored keys: a key cached at position p, rotated by (q - p), is the key at q.

Keys are stored after RoPE (rotate-half layout: dims d and d + D/2 share frequency d). With M-RoPE
each frequency belongs to one position axis (temporal, height, width), so the rotation angle of
frequency f is delta[axis[f]] * inv_freq[f]. Used to compact positions (reindex) and to move keys to
a summary slot.
"""

from __future__ import annotations

import numpy as np

from mmkv_cli.core.lazy import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_keys(
    keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor
) -> torch.Tensor:
    """keys [H, n, D] post-RoPE, delta [P, n] position change per axis -> keys at the new positions.

    inv_freq [D/2] and axes [D/2] (the position axis each frequency reads; all 0 for 1-D RoPE).
    """
    # the tables and deltas are host bookkeeping: sent to the keys' device without a wait
    delta = delta.to(keys.device, non_blocking=delta.device.type == "cpu")
    frequencies = inv_freq.to(
        keys.device, torch.float64, non_blocking=inv_freq.device.type == "cpu"
    )
    axes = axes.to(keys.device, non_blocking=axes.device.type == "cpu")
    angle = delta.to(torch.float64)[axes].T * frequencies  # [n, D/2]
    angle = torch.cat([angle, angle], dim=-1)
    k = keys.to(torch.float64)
    out = k * angle.cos() + rotate_half(k) * angle.sin()
    return out.to(keys.dtype)


def unrotate(keys: torch.Tensor, positions: torch.Tensor, inv_freq, axes) -> torch.Tensor:
    """Keys (or queries) [H, n, D] cached at positions [P, n] as they were before RoPE: each token
    rotated back by its own position, so it no longer says where it sat."""
    return rotate_keys(keys, -positions, inv_freq, axes)


def compact_positions(positions: torch.Tensor, start: int) -> torch.Tensor:
    """Positions [P, n] of tokens in context order, packed into consecutive slots from `start`.

    Tokens sharing a temporal position form a group (an M-RoPE frame grid; every 1-D token is its
    own group) and move together, so a grid keeps its shape. A grid right after a grid takes the
    next temporal slot, as frames of one video do; anything else starts after the largest position
    so far, as text after a video does.
    """
    n = positions.shape[1]
    if n == 0:
        return positions.clone()
    pos = positions.detach().cpu().numpy()
    t = pos[0]
    # per group: first token, size, its temporal position, how far it reaches beyond it, and whether
    # it is a grid (several tokens, or one whose height/width positions differ from the temporal)
    first = np.flatnonzero(np.concatenate([[True], t[1:] != t[:-1]]))
    size = np.diff(np.append(first, n))
    reach = np.maximum.reduceat(pos.max(axis=0), first) - t[first]
    odd = np.logical_or.reduceat((pos != t[None]).any(axis=0), first)
    grid = (size > 1) | odd
    # A run of grids (frames one after another) takes consecutive slots from the first free one;
    # anything else is a run of its own. Each run ends at its first slot plus the furthest its
    # groups reach, so every run's first slot is a running sum (an hour of 1-D tokens is 350K
    # groups: no loop over them).
    runs = np.flatnonzero(np.concatenate([[True], ~(grid[1:] & grid[:-1])]))
    run_of = np.repeat(np.arange(len(runs)), np.diff(np.append(runs, len(first))))
    within = np.arange(len(first)) - runs[run_of]
    furthest = np.maximum.reduceat(within + reach, runs)
    firsts = start + np.concatenate([[0], np.cumsum(1 + furthest)[:-1]])
    base = firsts[run_of] + within
    shift = np.repeat(base - t[first], size)
    return positions + torch.from_numpy(shift).to(positions)
