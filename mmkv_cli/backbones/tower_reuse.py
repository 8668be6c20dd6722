"""STC's cacher on a SigLIP vision tower (the authors' `forward_with_selective_key_recompute`):
every `every`-th frame of the stream runs each encoder layer whole and leaves, per layer, its keys,
values, attention output and MLP output; each frame after it, until the next, recomputes per layer
only the `share` of its tokens whose keys are least like that frame's (cosine), attending with its
own keys to values that are the reference's but for those tokens, and takes the reference's
attention and MLP outputs for the rest. The state passed from chunk to chunk is a new dict each
time (a live stream's copy keeps the one it had)."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


def changed_tokens(keys: torch.Tensor, reference: torch.Tensor, share: float) -> torch.Tensor:
    """The tokens a reusing frame recomputes: the max(1, int(n x share)) whose keys [n, C] are
    least like the reference's (cosine; ties to the earlier token), ascending by likeness."""
    count = max(1, min(len(keys), int(len(keys) * share)))
    likeness = torch.nn.functional.cosine_similarity(keys.float(), reference.float(), dim=-1)
    return torch.sort(likeness, stable=True).indices[:count]


def whole_frame(layer, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """One frame [n, C] through the layer, and what a reusing frame needs of it: its keys, values,
    attention output and MLP output [n, C]."""
    attention = layer.self_attn
    normed = layer.layer_norm1(hidden)
    q, k, v = attention.q_proj(normed), attention.k_proj(normed), attention.v_proj(normed)
    mixed = attend(attention, q, k, v)
    after = hidden + mixed
    mlp = layer.mlp(layer.layer_norm2(after))
    return after + mlp, (k, v, mixed, mlp)


def reusing_frame(layer, hidden: torch.Tensor, reference: tuple, share: float) -> torch.Tensor:
    """One frame [n, C] through the layer, recomputing only its changed tokens."""
    ref_k, ref_v, ref_mixed, ref_mlp = reference
    attention = layer.self_attn
    normed = layer.layer_norm1(hidden)
    keys = attention.k_proj(normed)
    changed = changed_tokens(keys, ref_k, share)
    chosen = normed[changed]
    values = ref_v.clone()
    values[changed] = attention.v_proj(chosen)
    mixed = ref_mixed.clone()
    mixed[changed] = attend(attention, attention.q_proj(chosen), keys, values)
    after = hidden + mixed
    mlp = ref_mlp.clone()
    mlp[changed] = layer.mlp(layer.layer_norm2(after)[changed])
    return after + mlp


def attend(attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SigLIP's attention of queries [m, C] over keys, values [n, C] (no mask: every patch sees
    every patch of its frame), through its output projection."""
    heads = attention.num_heads

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(len(x), heads, -1).transpose(0, 1)

    out = torch.nn.functional.scaled_dot_product_attention(
        split(q), split(k), split(v), scale=attention.scale
    )
    return attention.out_proj(out.transpose(0, 1).reshape(len(q), -1))


@contextmanager
def reused_layers(layers, state: dict, every: int, share: float) -> Iterator[dict]:
    """Inside the block, the layers run a chunk's frames reusing as STC does; the dict yielded
    holds the state for the next chunk once the block ends (`frames`: how many the stream has
    given; `layer.N`: that layer's reference frame's keys, values, attention and MLP outputs,
    stacked)."""
    after = dict(state)
    first = int(state.get("frames", 0))

    def forward(layer, index: int):
        def run(self, hidden_states, attention_mask=None, **kwargs):
            if attention_mask is not None:  # the towers mmkv runs pass none; never guess one
                return type(self).forward(self, hidden_states, attention_mask, **kwargs)
            out = torch.empty_like(hidden_states)
            held = after.get(f"layer.{index}")  # [4, n, C]: keys, values, attention, MLP
            reference = None if held is None else tuple(held.to(hidden_states).unbind(0))
            for frame, hidden in enumerate(hidden_states):
                if (first + frame) % every == 0 or reference is None:
                    out[frame], reference = whole_frame(self, hidden)
                else:
                    out[frame] = reusing_frame(self, hidden, reference, share)
            after[f"layer.{index}"] = torch.stack(reference)
            after["frames"] = torch.tensor(first + len(hidden_states))
            return out

        return types.MethodType(run, layer)

    for index, layer in enumerate(layers):
        layer.forward = forward(layer, index)
    try:
        yield after
    finally:
        for layer in layers:
            del layer.forward


def run_reusing(layers, state: dict, every: int, share: float, run: Callable[[], T]):
    """(run()'s result with the tower's layers reusing, the state for the next chunk)."""
    with reused_layers(layers, state, every, share) as after:
        result = run()
    return result, after
