"""Attention scores without eager attention maps.

The language model runs on SDPA through an attention function registered as "mmkv". While a
`Recorder` is active, that function also keeps, for the layers asked for, what a method needs: the
post-RoPE queries, or the column sums of softmax(QK^T/sqrt(d)) over the query rows, without ever
holding heads x n x n for the whole sequence.

On the CPU, recording runs on fused kernels: the layer's output and each row's log-sum-exp (lse)
come from flash attention, and the column sums from a second flash pass with the roles swapped (the
keys ask, the query rows answer, each biased by -lse), so no score block is written to memory.
Elsewhere (CUDA), the scores are computed a few query rows at a time. Both are exact; the tests
hold them to each other (fused_attention.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import contextmanager

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.recorder import Recorder
from mmkv_cli.kernels.scores import causal_column_sums, causal_rows, recorded_attention

__all__ = [
    "Recorder",
    "Splice",
    "masking",
    "causal_column_sums",
    "causal_rows",
    "install",
    "recording",
    "splicing",
]

NAME = "mmkv"
# the same attention for a model that flash attention runs, which makes no causal mask ("flash" is
# not in the name: transformers reads any name holding it as the flash-attention package's)
UNMASKED_NAME = "mmkv_unmasked"
# A question's few query rows under a mask: transformers' SDPA then copies every cached key and
# value once per query head of a group (repeat_kv), the whole context 7 times at LLaVA-OV's widths.
# Up to this many rows, the group's heads are folded into the query rows instead (grouped_sdpa).
FOLD_ROWS = 1024

_sdpa = None  # transformers' SDPA attention, bound by install() (importing it costs seconds)
_active: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "mmkv_recorder", default=None
)
# (layer, queries [B, H, q, D] after RoPE, keys, values) -> the keys and values the layer attends:
# context that only the layer's own queries can choose, put in before its attention runs
Splice = Callable[[int, "torch.Tensor", "torch.Tensor", "torch.Tensor"], tuple]
_splice: contextvars.ContextVar[Splice | None] = contextvars.ContextVar("mmkv_splice", default=None)
# per layer, which of its first cached entries each KV head holds: a cache whose heads keep
# different tokens holds them padded to the longest head. Either a mask [H_kv, n] bool (any layout:
# the encode's running cache) or, padded before each head's own (an ask's context), where each
# KV head's entries start: then each head attends to its own slice, no padding computed
HeadMasks = dict[int, "torch.Tensor | tuple[int, ...]"]
_heads: contextvars.ContextVar[HeadMasks | None] = contextvars.ContextVar(
    "mmkv_heads", default=None
)


def _attention(module, query, key, value, attention_mask, **kwargs):
    recorder = _active.get()
    layer = module.layer_idx
    splice = _splice.get()
    if splice is not None:
        key, value = splice(layer, query, key, value)
    masks = _heads.get()
    held = masks.get(layer) if masks is not None else None
    if held is not None:
        if recorder is not None and layer in recorder.layers:
            raise RuntimeError("internal: attention is not recorded over a cache held per head")
        if isinstance(held, tuple):
            return head_slices(module, query, key, value, held, **kwargs)
        if query.shape[2] * (query.shape[1] // key.shape[1]) > FOLD_ROWS:  # a chunk's rows
            return held_keys_only(module, query, key, value, held, **kwargs)
        mask = with_heads(query, key, own_length_mask(query, key, attention_mask), held)
        return grouped_sdpa(module, query, key, value, mask, **kwargs)
    if recorder is not None and layer in recorder.layers:
        if recorder.queries:
            recorder.query[layer] = query.detach()
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        if recorder.column_sums or recorder.reducers:  # every row of a prefill: one pass for both
            return recorded_attention(recorder, layer, query, key, value, scaling), None
        if recorder.rows:  # a question's few rows: SDPA answers, as an unrecorded ask would
            recorder.row[layer] = causal_rows(query.detach(), key.detach(), scaling)
    # transformers' mask is causal and nothing else: mmkv never runs the model padded
    return grouped_sdpa(module, query, key, value, attention_mask, causal=True, **kwargs)


def grouped_sdpa(module, query, key, value, mask, causal: bool = False, **kwargs):
    """transformers' SDPA attention -> ([B, q, H, D], None), without its copy of every cached key
    and value once per query head of a group (repeat_kv) under a mask, wherever a kernel can read
    grouped heads as they are. Each row's attention is the same arithmetic:

    - on CUDA, where `causal` says the mask hides from each query row only the keys after its own
      (the queries the newest entries): flash attention aligned to the last key, with no mask,
      not even one made for the layer's own length (an encode's chunk over its cache: under a
      mask transformers' kernel had been memory-efficient attention, which takes no grouped
      heads, and a chunk's mask over an hour's keys is a GB);
    - up to FOLD_ROWS rows (a question): the group's query heads folded into the query rows
      ([B, H_kv, group * q, D]) and the mask repeated for them;
    - more rows on the CPU: SDPA given the mask and the grouped heads (its flash kernel takes
      both; a chunk's folded mask would outgrow the copy it saves).

    causal: `mask` is the model's causal mask, made for layer 0's length (or None); the layer's
    own is made from it where one is needed (own_length_mask)."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    plain = not (
        kwargs.get("dropout")
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    scale = kwargs.get("scaling")
    if (
        causal
        and plain
        and q_len > 1
        and kwargs.get("sliding_window") is None
        and _flash_lower_right(query, key, value)
    ):
        # aligned to the last key, which SDPA hands to flash attention as its own causal flag
        # (is_causal=True would align the rows to the first keys)
        from torch.nn.attention.bias import causal_lower_right

        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q_len, key.shape[2]), scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    if causal:
        mask = own_length_mask(query, key, mask)
    # no mask: SDPA takes grouped heads itself; one row: transformers folds it itself
    if (
        mask is None
        or q_len == 1
        or not plain
        or group == 1
        or mask.shape[1] not in (1, heads)
        or mask.shape[2] != q_len
    ):
        return _sdpa(module, query, key, value, mask, **kwargs)
    if group * q_len > FOLD_ROWS:
        if query.device.type != "cpu":  # CUDA's kernel under a mask takes no grouped heads
            return _sdpa(module, query, key, value, mask, **kwargs)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    rows = query.reshape(batch, kv_heads, group * q_len, dim)
    if mask.shape[1] == 1:
        mask = mask.repeat(1, 1, group, 1)
    else:  # a mask per query head: each KV head's group of them, one after another
        mask = mask.reshape(mask.shape[0], kv_heads, group * q_len, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=mask, scale=scale
    )
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def _flash_lower_right(query, key, value) -> bool:
    """Whether flash attention runs these tensors (CUDA, half precision, a head size it takes)
    with the grouped heads as they are. A host check of shapes and dtypes: no device wait."""
    if query.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, True))


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


def with_heads(
    query: torch.Tensor, key: torch.Tensor, causal: torch.Tensor | None, held: torch.Tensor
) -> torch.Tensor:
    """The causal mask ([1, 1, q, k] bool, or None: all visible) narrowed per query head to the
    cached entries its KV head holds (`held` [H_kv, n], n <= k; the entries after n are the
    forward's own and every head's) -> [1, H, q, k] bool."""
    q_len, k_len = query.shape[2], key.shape[2]
    group = query.shape[1] // held.shape[0]
    held = held.to(key.device, non_blocking=True)  # host to device: no wait
    rest = torch.ones(held.shape[0], k_len - held.shape[1], dtype=torch.bool, device=key.device)
    heads = torch.cat([held, rest], dim=1).repeat_interleave(group, dim=0)[None, :, None, :]
    if causal is None:
        return heads.expand(1, -1, q_len, -1)
    if causal.dtype != torch.bool:  # an additive mask: 0 where seen
        causal = causal == 0
    return causal & heads


def held_keys_only(module, query, key, value, held: torch.Tensor, **kwargs):
    """Attention of many rows (a chunk prefilled over a cache held per head) with each KV head's
    query group over the cached entries that head holds (`held` [H_kv, n]) and the forward's own,
    gathered: causal aligned to the last key, and no mask of [heads, rows, keys] (at 7B, a
    chunk's over a per-head InfiniPot-V cache was over a GB a layer) -> ([B, q, H, D], None)."""
    group, n, k_len = query.shape[1] // key.shape[1], held.shape[1], key.shape[2]
    own = torch.arange(n, k_len)
    out = []
    for head, row in enumerate(held.cpu()):  # host bookkeeping: no wait
        at = torch.cat([row.nonzero().squeeze(1), own]).to(key.device, non_blocking=True)
        k, v = key[:, head : head + 1, at], value[:, head : head + 1, at]
        q = query[:, head * group : (head + 1) * group]
        out.append(grouped_sdpa(module, q, k, v, None, causal=True, **kwargs)[0])
    return torch.cat(out, dim=2), None


def head_slices(module, query, key, value, starts: tuple[int, ...], **kwargs):
    """Attention when KV head h's cached entries are its row from starts[h] on (the padding
    before them never read): heads with one start attend together, each run over its own keys
    (views, no copy) with a causal mask for its own length -> ([B, q, H, D], None)."""
    group = query.shape[1] // key.shape[1]
    out, first = [], 0
    for head in range(1, len(starts) + 1):
        if head < len(starts) and starts[head] == starts[first]:
            continue
        at = starts[first]
        k, v = key[:, first:head, at:], value[:, first:head, at:]
        q = query[:, first * group : head * group]
        out.append(grouped_sdpa(module, q, k, v, None, causal=True, **kwargs)[0])
        first = head
    return torch.cat(out, dim=2), None


def install(model, heads: int, kv_heads: int, head_dim: int) -> None:
    """Route the language model's attention (not the vision tower's) through the recording
    function, on attention kernels that need no plan per shape (`plan_free_attention`).

    Where flash attention runs this model's heads (`_flash_lower_right`), the model makes no
    causal mask for a forward (`UNMASKED_NAME`): a chunk's rows over an hour's keys are a GB of
    mask, which the flash path never reads. A layer that needs one after all makes its own."""
    global _sdpa
    parameter = next(model.parameters())
    plan_free_attention(parameter.device)
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa = sdpa_attention_forward
    for name, mask in ((NAME, sdpa_mask), (UNMASKED_NAME, _causal_unmade)):
        AttentionInterface.register(name, _attention)
        AttentionMaskInterface.register(name, mask)
    probe = [
        torch.empty(1, n, 2, head_dim, dtype=parameter.dtype, device=parameter.device)
        for n in (heads, kv_heads, kv_heads)
    ]
    flash = _flash_lower_right(*probe)
    model.config.get_text_config()._attn_implementation = UNMASKED_NAME if flash else NAME


def _causal_unmade(*args, **kwargs):
    """transformers' SDPA mask, except the plain causal one of rows over keys (no padding, no
    window), which is left unmade (None): `_attention` declares it causal, and grouped_sdpa's
    flash path or `own_length_mask` stands for it."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = (
        not args
        and kwargs.get("mask_function") is causal_mask_function
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
    )
    return None if plain else sdpa_mask(*args, **kwargs)


def plan_free_attention(device) -> None:
    """On CUDA, SDPA without cuDNN's kernel, which torch tries first on Hopper and later GPUs:
    cuDNN builds an execution plan for each new pair of query and key lengths (docs/benchmarks.md,
    "One H100"), and every chunk of an encode (its cache grows) and every question is a new pair.
    Flash and memory-efficient attention plan nothing. Torch's backend switches are the process's,
    not a thread's: set once, on a model's load."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


@contextmanager
def _set(var: contextvars.ContextVar, value):
    """`var` holds `value` inside the block (this thread or task only), as it was after."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def splicing(splice: Splice):
    """Let `splice` change each layer's keys and values before its attention, for one forward."""
    return _set(_splice, splice)


def masking(masks: HeadMasks):
    """Let each layer's KV heads see only the cached entries `masks` says they hold, for the
    forwards inside the block (an ask's prefill and decode over a cache held per head)."""
    return _set(_heads, masks)


def recording(recorder: Recorder):
    """Record what `recorder` asks for in the forwards inside the block."""
    return _set(_active, recorder)
