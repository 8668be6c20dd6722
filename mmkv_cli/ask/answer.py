"""pack + context policy + question -> cache -> answer, streamed (generation: generate.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch

from mmkv_cli.ask.generate import generate
from mmkv_cli.ask.heads import join_heads, rotate_pieces
from mmkv_cli.ask.layerwise import in_forward_splice, question_vector
from mmkv_cli.ask.prune import AskPrune, prune_context
from mmkv_cli.ask.result import Answer
from mmkv_cli.ask.taken_in import PackTakenIn
from mmkv_cli.backbones.base import Backbone
from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.core.options import AskOptions
from mmkv_cli.kernels.attention import Recorder, masking, recording, splicing
from mmkv_cli.kernels.rope import compact_positions, rotate_keys
from mmkv_cli.methods.base import ContextPolicy
from mmkv_cli.pack import LaterVerdicts, PackReader


class PhaseClock:
    """Seconds per phase of one ask. On CUDA each lap waits for the queued kernels first, so a
    phase's time is the work it queued, not whatever the next one happened to wait for."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now


def check_compatible(reader: PackReader, backbone: Backbone) -> None:
    """Refuse a backbone other than the pack's own, in one line that says what differs."""
    made = reader.header.fingerprint.as_stored()
    here = backbone.fingerprint()
    differs = {"family": "family", "config_sha256": "configuration", "weights_sha256": "weights"}
    for key, what in differs.items():
        if made.get(key) == here.get(key):
            continue
        theirs = f"'{made.get('model')}' ({made.get('family')}, config {made.get('config_sha256')}"
        if made.get("model") == here["model"]:  # one name, built otherwise (a cut depth, say)
            layers = (reader.header.kv.layers, backbone.kv_shape()["layers"])
            depth = [f"{n} layer{'s' * (n != 1)}" for n in layers]
            raise PackError(
                f"{reader.path} was made with another {what} of {theirs}, {depth[0]}; here: "
                f"config {here.get('config_sha256')}, {depth[1]}): ask with the model it was made "
                "with, or re-encode it"
            )
        raise PackError(
            f"{reader.path} was made with model {theirs}), not '{here['model']}': re-encode it "
            "with this model"
        )
    check_kv_shape(reader, backbone)


def check_kv_shape(reader: PackReader, backbone: Backbone) -> None:
    """Refuse a pack whose KV (layers x KV heads x head width) is not the model's, whatever its
    fingerprint says (a forged header, a preset built otherwise), before any block is read."""
    kv, model = reader.header.kv, backbone.kv_shape()
    stored = (kv.layers, kv.kv_heads, kv.head_dim)
    wanted = (model["layers"], model["kv_heads"], model["head_dim"])
    if stored != wanted:
        shape = " x ".join(map(str, stored))
        raise PackError(
            f"{reader.path}: the pack's KV ({shape}, layers x KV heads x head width) does not fit "
            f"the model ({' x '.join(map(str, wanted))})"
        )


def build_cache(
    backbone: Backbone,
    reader: PackReader,
    names: list[str],
    positions: str = "keep",
    ends_at: str | None = None,
    per_layer: list[list[str]] | None = None,
    later: LaterVerdicts | None = None,
):
    """Concatenate prefix + chosen blocks + suffix per layer into a fresh cache.

    positions "keep": stored positions, the question at the stored next position. "reindex": every
    layer's context compacted to consecutive slots, keys re-rotated by the change, the question
    right after. ends_at: the last block shown by the question's moment. The stream ends there for
    this question, so the stored suffix (which attended to the whole stream) is left out and re-run,
    with the question, just after the context: `lead` holds its embeddings, positions and first
    position (on the host). per_layer:
    the blocks of each layer, when retrieval chose them layer by layer. A pack held per head is
    built head by head, then joined per layer (ask/heads.py). Returns (cache, context tokens, the
    question's first position, lead or None, per layer whose heads hold different numbers of
    entries where each head's start in the cache). later: where a context decoded on the device
    leaves its NaN/Inf verdict, for the first token to read.
    """
    prefix = reader.span("prefix")
    layers = len(prefix.keys)  # held per head: (layer, KV head) pairs
    split = reader.header.kv.per_head  # K/V kept in pieces, joined once into the padded cache
    if per_layer is not None and split:
        per_layer = [taken for taken in per_layer for _ in range(reader.header.kv.kv_heads)]
    parts = [(prefix.keys, prefix.values, prefix.positions)]
    gathered = None
    if names:
        # joined per layer in context order; a quantized pack's blocks decode on the model's device
        gathered = reader.gather(names, per_layer, backbone.device, later=later)
        parts.append(gathered)
    if ends_at is None:
        suffix = reader.span("suffix")
        parts.append((suffix.keys, suffix.values, suffix.positions))
    keys, values, kept_positions = [], [], []
    for layer in range(layers):
        for i, (joined, where) in enumerate(
            ((keys, backbone.device), (values, backbone.device), (kept_positions, "cpu"))
        ):
            # to the device without a wait (host to device); positions stay on the host
            ahead = where != "cpu"
            pieces = [p[i][layer].to(where, non_blocking=ahead) for p in parts]
            joined.append(pieces if split and i < 2 else torch.cat(pieces, 1))
            if gathered:  # let go of the layer as it is joined: the context is held once
                gathered[i][layer] = None
    # stored: never derived from the cache length
    stored_next = int(reader.header.layout.next_position)
    next_position = stored_next
    end = None  # where the context ends (keep: the last position shown by the moment, + 1)
    if positions == "reindex":
        inv_freq, axes = backbone.rope_tables()
        end = 0
        for layer in range(layers):
            old = kept_positions[layer]
            new = compact_positions(old, 0)
            if split:
                keys[layer] = rotate_pieces(keys[layer], new - old, inv_freq, axes)
            else:
                keys[layer] = rotate_keys(keys[layer], new - old, inv_freq, axes)
            end = max(end, int(new.max()) + 1 if new.numel() else 0)
        next_position = end
    elif positions != "keep":
        raise UsageError(f"unknown position mode '{positions}' (keep, reindex)")
    elif ends_at is not None:
        shown = [*kept_positions, *reader.span(ends_at).positions]
        end = max(int(p.max()) for p in shown if p.numel()) + 1
    lead = None
    if ends_at is not None:
        stored = reader.span("suffix").positions[0]
        start = int(stored.min()) if stored.numel() else stored_next
        # the stored suffix re-run right after what was shown, on the backbone's device
        first = int(stored[0, 0]) - start + end if stored.numel() else next_position
        lead = (backbone.suffix_embeds(), (stored - start + end).to(backbone.device), first)
        next_position = stored_next - start + end
    starts: dict = {}
    if split:
        keys, values, starts = join_heads(keys, values, reader.header.kv.kv_heads)
    return (
        backbone.cache_from_layers(keys, values, adopt=True),
        max(int(k.shape[1]) for k in keys),
        next_position,
        lead,
        starts,
    )


def _context_blocks(reader: PackReader, names: list[str]) -> list[dict]:
    """Every block of a context no retrieval chose, with the span it shows (no scores)."""
    listed = []
    for name in names:
        row = reader.blocks[reader.blocks.index_of(name)]
        listed.append(
            {"block": name, "granularity": row["granularity"], "time": row["time"], "score": None,
             "reranked": None}
        )  # fmt: skip
    return listed


def _representatives(reader: PackReader) -> torch.Tensor:
    reps = reader.representatives()
    if reps is None:
        raise PackError(
            f"{reader.path} stores no block representatives, so its blocks cannot be retrieved"
        )
    return reps


@torch.inference_mode()
def answer_from_pack(
    backbone: Backbone,
    reader: PackReader,
    policy: ContextPolicy,
    question: str,
    options: AskOptions,
    prune: AskPrune | None = None,
    on_token: Callable[[str], None] | None = None,
) -> Answer:
    """Answer `question` from the blocks `policy` selects of `reader`'s pack: the context's cache
    built from them, the question prefilled (and the context pruned by it, with `prune`), then
    decoded. The phases are timed from one origin, so they add up to the TTFT."""
    check_compatible(reader, backbone)
    clock = PhaseClock(backbone.device)
    start = clock.last
    asked, ids = _question_ids(backbone, reader, question, options.history)
    selection = policy.select(
        reader.blocks,
        lambda: _representatives(reader),
        lambda mode: question_vector(backbone, reader, asked, mode),
        options.at,
        PackTakenIn(backbone, reader, asked),
    )
    clock.lap("select")
    positions_mode = options.positions.value if options.positions else policy.position_mode
    layerwise = selection.in_forward
    built_as = "keep" if layerwise is not None else positions_mode  # reindexed layer by layer
    if reader.header.kv.per_head and (prune or layerwise is not None):
        what = "--prune" if prune else "retrieval inside the forward"
        raise UsageError(f"{reader.path} is held per head: {what} is for packs held per layer")
    later = LaterVerdicts(str(reader.path))  # read with the first token: no wait of its own
    cache, context, position, lead, heads = build_cache(
        backbone, reader, selection.names, built_as, selection.ends_at, selection.per_layer, later
    )
    clock.lap("read")
    embeds, positions = backbone.embed_ids(ids), backbone.text_positions(position, len(ids))
    if lead is not None:
        embeds = torch.cat([lead[0], embeds], dim=1)
        positions = torch.cat([lead[1], positions], dim=1)
    recorder = Recorder(layers=set(range(len(cache.layers))), rows=True) if prune else None
    splice, spent = None, {}  # spent: what the layers took choosing and reading, in the forward
    if layerwise is not None:  # each layer's blocks read in as the forward reaches it
        first = position if lead is None else lead[2]
        reindex_to = first if positions_mode == "reindex" else None
        splice = in_forward_splice(
            backbone, reader, layerwise, cache, positions, len(asked), lead is None, reindex_to,
            spent, later,
        )  # fmt: skip
    with (
        recording(recorder) if recorder else nullcontext(),
        splicing(splice) if splice else nullcontext(),
        masking(heads),  # a head held per head sees only its own entries, here and decoding
    ):
        hidden = backbone.forward(embeds, positions, cache)
    if layerwise is not None:
        selection = layerwise.selection()
        context = max(int(entry.keys.shape[2]) for entry in cache.layers) - embeds.shape[1]
    names = selection.names
    position += len(ids)
    kv_tokens = None
    if prune:
        visual = _visual_tokens(reader, selection.per_layer or [names] * len(cache.layers))
        prefix_counts = reader.span("prefix").layer_counts
        kv_tokens = prune_context(
            cache, recorder.row, prefix_counts, visual, embeds.shape[1], prune
        )
    logits = backbone.logits(hidden[:, -1])[0]
    first_logits = logits.cpu().clone() if options.keep_logits else None
    clock.lap("prefill")
    for phase, seconds in spent.items():  # the forward's own share stays prefill; the sum holds
        clock.phases[phase] += seconds
        clock.phases["prefill"] -= seconds
    generation_start = clock.last
    with masking(heads):
        made, decode_s = _decode(backbone, cache, logits, position, options, on_token, later)
    total = time.perf_counter() - start
    return Answer(
        answer=made.text.strip(),
        token_ids=made.token_ids,
        context_tokens=context + embeds.shape[1],
        ttft_s=generation_start - start + made.first_token_s,
        total_s=total,
        decode_s_per_token=decode_s,
        blocks_used=names,
        retrieved=selection.explain or (_context_blocks(reader, names) if options.explain else []),
        bytes_read=reader.bytes_read,
        first_logits=first_logits,
        kv_tokens=kv_tokens,
        phases_s={**clock.phases, "first_token": made.first_token_s},
    )


def _decode(backbone: Backbone, cache, logits, position: int, options: AskOptions, on_token, later):
    """Generate from the prefill's last logits, a token a forward: (what was made, seconds per
    decode step after the first token)."""
    decode_start = 0.0  # when the first decode step began

    def step(token: int) -> torch.Tensor:
        nonlocal position, decode_start
        decode_start = decode_start or time.perf_counter()
        out = backbone.forward(
            backbone.embed_ids([token]), backbone.text_positions(position, 1), cache
        )
        position += 1
        return backbone.logits(out[:, -1])[0]

    made = generate(
        logits, step, backbone.decode, backbone.stop_ids(), options.generation, on_token,
        later=later,
    )  # fmt: skip
    steps = len(made.token_ids) - 1
    # None for a one-token answer: no decode step ran, so there is no rate to report
    decode_s = (time.perf_counter() - decode_start) / steps if steps > 0 and decode_start else None
    return made, decode_s


def _question_ids(backbone: Backbone, reader: PackReader, question: str, history):
    """(the question's tokens, which retrieval reads; what the model reads: the earlier turns,
    then the question), in the pack's question template."""
    template = reader.header.prompt.question
    ids = backbone.question_ids(question, template)
    if not ids:
        raise PackError("the question is empty after tokenisation")
    return ids, backbone.turns_ids(history, template) + ids


def _visual_tokens(reader: PackReader, taken: list[list[str]]) -> list[int]:
    """The context's visual tokens per layer, from the table's columns (no per-block dicts)."""
    totals = reader.blocks.layer_totals()
    return [
        int(totals[np.asarray([reader.blocks.index_of(n) for n in chosen], int), layer].sum())
        for layer, chosen in enumerate(taken)
    ]
