"""The attention each visual token gets in the vision tower, for the token reducers that read it
(StreamingTOM's CTR, VisionZip): in the layer that makes the features, every patch's attention from
every patch of its frame (mean over heads and queries), then pooled to the language model's tokens
as the features are. The layer's input is taken on the way through the tower's one pass, and its
attention is computed again here a frame at a time, so no [heads, patches, patches] map of a whole
chunk is ever held (34 MB a frame at SigLIP's 729 patches)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def layer_inputs(module: torch.nn.Module) -> Iterator[list[tuple[tuple, dict]]]:
    """Inside the block, every call of `module` leaves its (args, kwargs) in the list."""
    seen: list[tuple[tuple, dict]] = []
    hook = module.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True
    )
    try:
        yield seen
    finally:
        hook.remove()


def received(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """[n]: the attention each of n tokens gets, mean over heads and queries. queries, keys
    [heads, n, d]."""
    probs = torch.softmax(queries.float() @ keys.float().transpose(1, 2) * scale, dim=-1)
    return probs.mean(dim=(0, 1))


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The Qwen towers' 2-D rotary embedding: x [n, heads, d], cos and sin [n, d]."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x.float() * cos[:, None].float() + turned.float() * sin[:, None].float()


def qwen_received(attention: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """[patches]: what a Qwen vision attention layer's call gave each patch, segment by segment
    (cu_seqlens: a temporal step each in the full-attention layers), in the order it saw them."""
    hidden = kwargs.get("hidden_states", *args[:1])
    cu = kwargs["cu_seqlens"].tolist()
    cos, sin = kwargs["position_embeddings"]
    n = hidden.shape[0]
    q, k, _ = attention.qkv(hidden).reshape(n, 3, attention.num_heads, -1).unbind(1)
    q, k = rotated(q, cos, sin), rotated(k, cos, sin)
    out = torch.empty(n, device=hidden.device)
    for start, stop in zip(cu[:-1], cu[1:]):
        part = slice(start, stop)
        out[part] = received(q[part].transpose(0, 1), k[part].transpose(0, 1), attention.scaling)
    return out


def siglip_received(attention: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """[frames, patches]: what a SigLIP attention layer's call gave each patch of each frame."""
    hidden = kwargs.get("hidden_states", *args[:1])
    out = []
    for frame in hidden:
        q = attention.q_proj(frame).view(len(frame), attention.num_heads, -1).transpose(0, 1)
        k = attention.k_proj(frame).view(len(frame), attention.num_heads, -1).transpose(0, 1)
        out.append(received(q, k, attention.scale))
    return torch.stack(out)
