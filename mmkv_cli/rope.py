"""Delta rotation of stored keys: a key cached at position p, rotated by (q - p), is the key at q.

Keys are stored after RoPE (rotate-half layout: dims d and d + D/2 share frequency d). With M-RoPE
each frequency belongs to one position axis (temporal, height, width), so the rotation angle of
frequency f is delta[axis[f]] * inv_freq[f]. Used to compact positions (reindex) and to move keys to
a summary slot.
"""

from __future__ import annotations

from mmkv_cli.lazy import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_keys(
    keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor
) -> torch.Tensor:
    """keys [H, n, D] post-RoPE, delta [P, n] position change per axis -> keys at the new positions.

    inv_freq [D/2] and axes [D/2] (the position axis each frequency reads; all 0 for 1-D RoPE).
    """
    delta = delta.to(keys.device)
    angle = delta.to(torch.float64)[axes.to(keys.device)].T * inv_freq.to(
        keys.device, torch.float64
    )  # [n, D/2]
    angle = torch.cat([angle, angle], dim=-1)
    k = keys.to(torch.float64)
    out = k * angle.cos() + rotate_half(k) * angle.sin()
    return out.to(keys.dtype)


def compact_positions(positions: torch.Tensor, start: int) -> torch.Tensor:
    """Positions [P, n] of tokens in context order, packed into consecutive slots from `start`.

    Tokens sharing a temporal position form a group (an M-RoPE frame grid; every 1-D token is its
    own group) and move together, so a grid keeps its shape. A grid right after a grid takes the
    next temporal slot, as frames of one video do; anything else starts after the largest position
    so far, as text after a video does.
    """
    out = positions.clone()
    if positions.shape[1] == 0:
        return out
    t = positions[0]
    starts = torch.ones_like(t, dtype=torch.bool)
    starts[1:] = t[1:] != t[:-1]
    bounds = torch.cat([starts.nonzero().squeeze(1), torch.tensor([t.numel()])]).tolist()
    top, last_t, last_grid = start - 1, None, False
    for a, b in zip(bounds[:-1], bounds[1:]):
        group = positions[:, a:b]
        grid = b - a > 1 or bool((group != group[0]).any())
        base = last_t + 1 if grid and last_grid else top + 1
        out[:, a:b] = group + (base - int(group[0, 0]))
        top, last_t, last_grid = max(top, int(out[:, a:b].max())), base, grid
    return out
