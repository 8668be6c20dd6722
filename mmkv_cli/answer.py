"""pack + context policy + question -> cache -> greedy answer, streamed token by token."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mmkv_cli.backbones import Backbone
from mmkv_cli.errors import PackError
from mmkv_cli.methods import ContextPolicy
from mmkv_cli.pack import PackReader


@dataclass
class Answer:
    answer: str
    token_ids: list[int]
    context_tokens: int
    ttft_s: float
    total_s: float
    decode_s_per_token: float
    blocks_used: list[str]
    first_logits: torch.Tensor | None = field(default=None, repr=False)


def check_compatible(reader: PackReader, backbone: Backbone) -> None:
    made = reader.header["fingerprint"]
    here = backbone.fingerprint()
    for key in ("family", "config_sha256", "weights_sha256"):
        if made.get(key) != here.get(key):
            raise PackError(f"{reader.path} was made with model '{made.get('model')}' ({made.get('family')}, "
                            f"config {made.get('config_sha256')}), not '{here['model']}': re-encode it with this model")


def build_cache(backbone: Backbone, reader: PackReader, names: list[str]):
    """Concatenate prefix + chosen blocks + suffix per layer into a fresh cache; returns (cache, tokens)."""
    segments = [reader.segment("prefix"), *(reader.segment(n) for n in names), reader.segment("suffix")]
    layers = len(segments[0].keys)
    keys = [torch.cat([s.keys[layer] for s in segments], dim=1) for layer in range(layers)]
    values = [torch.cat([s.values[layer] for s in segments], dim=1) for layer in range(layers)]
    return backbone.cache_from_layers(keys, values), max(int(k.shape[1]) for k in keys)


@torch.inference_mode()
def answer_from_pack(backbone: Backbone, reader: PackReader, policy: ContextPolicy, question: str,
                     max_new_tokens: int = 32, on_token: Callable[[str], None] | None = None,
                     keep_logits: bool = False) -> Answer:
    check_compatible(reader, backbone)
    start = time.perf_counter()
    names = policy.select(reader.blocks, question)
    cache, context = build_cache(backbone, reader, names)
    ids = backbone.question_ids(question, reader.header["prompt"]["question"])
    if not ids:
        raise PackError("the question is empty after tokenisation")
    position = int(reader.header["layout"]["next_position"])  # stored: never derived from the cache length
    hidden = backbone.forward(backbone.embed_ids(ids), backbone.text_positions(position, len(ids)), cache)
    position += len(ids)
    logits = backbone.logits(hidden[:, -1])
    first_logits = logits[0].cpu().clone() if keep_logits else None
    stops = backbone.stop_ids()
    out: list[int] = []
    shown = ""
    ttft = None
    decode_start = time.perf_counter()
    for _ in range(max_new_tokens):
        token = int(logits.argmax(dim=-1))
        if ttft is None:
            ttft = time.perf_counter() - start
            decode_start = time.perf_counter()
        if token in stops:
            break
        out.append(token)
        text = backbone.decode(out)
        if on_token and text != shown:
            on_token(text[len(shown):] if text.startswith(shown) else text)
        shown = text
        if len(out) == max_new_tokens:
            break
        hidden = backbone.forward(backbone.embed_ids([token]), backbone.text_positions(position, 1), cache)
        position += 1
        logits = backbone.logits(hidden[:, -1])
    total = time.perf_counter() - start
    steps = max(1, len(out) - 1)
    return Answer(answer=shown.strip(), token_ids=out, context_tokens=context + len(ids),
                  ttft_s=ttft or total, total_s=total,
                  decode_s_per_token=(time.perf_counter() - decode_start) / steps if len(out) > 1 else 0.0,
                  blocks_used=names, first_logits=first_logits)
