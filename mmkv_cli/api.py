"""The CLI's verbs as Python functions: encode, ask, inspect (profile lives in profile.py)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import torch

from mmkv_cli import __version__
from mmkv_cli.answer import Answer, answer_from_pack
from mmkv_cli.ask_prune import ask_pruner
from mmkv_cli.backbones import Backbone, load_backbone
from mmkv_cli.encoder import Progress, encode_media
from mmkv_cli.errors import UsageError
from mmkv_cli.media import load_media
from mmkv_cli.methods import build_method, context_policy
from mmkv_cli.pack import PackReader, check_writable, write_pack
from mmkv_cli.presets import load_model_preset


def media_defaults(
    model: str | None, backbone: Backbone, fps: float | None, max_frames: int | None
):
    preset = load_model_preset(model or backbone.name)
    return (
        fps if fps is not None else (preset.fps if preset else 1.0),
        max_frames if max_frames is not None else (preset.max_frames if preset else 64),
    )


def encode(
    media: str,
    output: str | Path,
    model: str | None = None,
    method: str = "full",
    budget: float | None = None,
    device: str = "auto",
    dtype: str = "auto",
    fps: float | None = None,
    max_frames: int | None = None,
    force: bool = False,
    backbone: Backbone | None = None,
    progress: Progress | None = None,
    on_start: Callable[[int], None] | None = None,
    budget_tokens: int | None = None,
) -> dict:
    """Encode `media` into a .kvpack at `output`; returns a summary (the inspect view plus timings)."""
    output = Path(output)
    check_writable(output, force)  # fail before any expensive work
    preset, policy = build_method(method, budget, budget_tokens)
    backbone = backbone or load_backbone(model, device, dtype)
    fps, max_frames = media_defaults(model, backbone, fps, max_frames)
    source = load_media(media, fps=fps, max_frames=max_frames)
    if on_start:
        on_start(source.num_frames)
    encoded = encode_media(
        backbone, source, policy, int(preset.params.get("chunk_frames", 16)), progress
    )
    header = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "mmkv_version": __version__,
        "fingerprint": backbone.fingerprint(),
        "method": {
            "name": method,
            "implements": preset.implements,
            "budget": policy.budget,
            "params": preset.params,
        },
        "media": source.describe(),
        "prompt": backbone.prompt.as_dict(),
        "layout": encoded.layout,
        "rotary": backbone.rotary(),
        "kv": backbone.kv_shape(),
        "visual_tokens_total": encoded.visual_tokens_total,
        "stats": {k: round(v, 4) if isinstance(v, float) else v for k, v in encoded.stats.items()},
    }
    write_pack(output, header, encoded.prefix, encoded.blocks, encoded.suffix, force=force)
    return {**inspect(output), **encoded.stats}


def ask(
    pack: str | Path,
    question: str,
    model: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    max_new_tokens: int = 32,
    backbone: Backbone | None = None,
    on_token: Callable[[str], None] | None = None,
    keep_logits: bool = False,
    at: float | None = None,
    positions: str | None = None,
    prune: str | None = None,
    budget: float | None = None,
) -> Answer:
    """Answer `question` from the pack alone; the media is never read again.

    at: the question's moment (seconds, or frame index for stills): only blocks that start by then count.
    positions: keep | reindex, overriding the method's preset.
    prune: a method that prunes the context's visual KV by the question's attention before decoding, keeping
    `budget` of it (default: that method's preset budget).
    """
    pruner = ask_pruner(prune, budget) if prune else None
    if budget is not None and not prune:
        raise UsageError("--budget at ask only applies with --prune METHOD")
    reader = PackReader(pack)
    backbone = backbone or load_backbone(
        model or reader.header["fingerprint"]["model"], device, dtype
    )
    method = reader.header["method"]
    params = dict(method.get("params") or {})
    if positions is not None:
        params["positions"] = positions
    policy = context_policy(method.get("implements") or method["name"], params)
    return answer_from_pack(
        backbone, reader, policy, question, max_new_tokens, on_token, keep_logits, at, pruner
    )


def inspect(pack: str | Path) -> dict:
    """What a pack holds, from its header and block table (no KV tensor is read)."""
    reader = PackReader(pack)
    h = reader.header
    kv = h["kv"]
    per_token = (
        2
        * kv["kv_heads"]
        * kv["head_dim"]
        * torch.empty(0, dtype=getattr(torch, kv["dtype"])).element_size()
    )
    counts = reader.blocks.layer_totals()  # [blocks, layers]
    layers = [{"index": i, "tokens_kept": int(n)} for i, n in enumerate(counts.sum(dim=0).tolist())]
    codes = reader.blocks.codes()
    granularities: dict[str, dict] = {}
    for code in dict.fromkeys(codes.tolist()):
        mine = counts[codes == code]
        granularities[reader.blocks.kinds[code]] = {
            "blocks": int(mine.shape[0]),
            "tokens": int(mine.max(dim=1).values.sum()),
            "bytes": int(mine.sum()) * per_token,
        }
    return {
        "path": str(reader.path),
        "format_version": h["format_version"],
        "model": h["fingerprint"]["model"],
        "family": h["fingerprint"]["family"],
        "method": h["method"]["name"],
        "budget": h["method"]["budget"],
        "budget_tokens": (h["method"].get("params") or {}).get("budget_tokens"),
        "media": {k: h["media"][k] for k in ("kind", "source", "digest", "frames")},
        "blocks": len(reader.blocks),
        "visual_tokens_total": h["visual_tokens_total"],
        "visual_tokens_kept": max((layer["tokens_kept"] for layer in layers), default=0),
        "prompt_tokens": h["segments"]["prefix"]["layer_counts"][0]
        + h["segments"]["suffix"]["layer_counts"][0],
        "bytes": reader.size,
        "kv_bytes": int(counts.sum()) * per_token,
        "layers": layers,
        "granularities": granularities,
        "positions": {
            "dims": h["layout"]["position_dims"],
            "next_position": h["layout"]["next_position"],
            "rope_deltas": h["layout"]["rope_deltas"],
        },
        "created": h["created"],
    }
