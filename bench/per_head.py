"""Per-head memory's cost (issue 51): a pack whose KV heads keep tokens of their own against a
per-layer pack of the same size, at a real model's width.

    python bench/per_head.py [--model rehearsal-llava-ov-0.5b] [--layers 4] [--frames 64]
        [--share 0.25] [--device auto]

One `full` encode of a synthetic clip gives a real header, prefix and suffix; its blocks are then
cut three ways, each keeping `share` of the visual tokens per layer (in (token, head) entries):
  per_layer  the same tokens in every head (as SnapKV or H2O `selection: per_layer` keep them)
  per_head   each KV head its own tokens, as many per head (H2O's and MEDA's code)
  ragged     each KV head its own tokens, head h keeping a share rising with h (AdaKV-like)
(A rehearsal model's random weights make its heads agree, so the per-head selection is drawn here.)
With --methods (issue 72: snapkv,pyramidkv), each method also encodes the clip itself, per KV head
(its default) and as its `-per-layer` preset, at --share, and the same figures compare the two.
Figures: the blocks' stored bytes over the bytes of the K/V they hold (the per-layer pack's, per
entry), and the ask TTFT (median of 7, one-token answers, the packs asked in turn) of each against
the per-layer pack's.
Writes bench/results/per_head.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from mmkv_cli import api  # noqa: E402
from mmkv_cli.backbones.loading import load_backbone  # noqa: E402
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions  # noqa: E402
from mmkv_cli.pack import PackReader, Span  # noqa: E402
from mmkv_cli.pack.access.writer import write_pack  # noqa: E402

QUESTION = "what happened first ?"
ONE_TOKEN = AskOptions(generation=GenerationOptions(max_new_tokens=1))


def head_shares(heads: int, share: float, how: str) -> list[float]:
    """Each head's share of the stream: equal, or rising with the head at the same mean."""
    if how != "ragged" or heads == 1:
        return [share] * heads
    weights = [1 + h for h in range(heads)]
    return [min(1.0, share * heads * w / sum(weights)) for w in weights]


def cut(block: Span, picks: list[list[torch.Tensor]], per_head: bool) -> Span:
    """Block's tokens at picks[layer][head] (indices into its layer run)."""
    if not per_head:
        at = [p[0] for p in picks]
        return replace(
            block,
            keys=[k[:, a] for k, a in zip(block.keys, at)],
            values=[v[:, a] for v, a in zip(block.values, at)],
            positions=[p[:, a] for p, a in zip(block.positions, at)],
            representative=None,
        )
    keys, values, positions = [], [], []
    for layer, heads in enumerate(picks):
        for head, a in enumerate(heads):
            keys.append(block.keys[layer][head : head + 1, a])
            values.append(block.values[layer][head : head + 1, a])
            positions.append(block.positions[layer][:, a])
    return replace(block, keys=keys, values=values, positions=positions, representative=None)


def variant(reader: PackReader, how: str, share: float, out: Path, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    kv = reader.header.kv
    per_head = how != "per_layer"
    shares = head_shares(kv.kv_heads, share, how)
    blocks = []
    for index in range(len(reader.blocks)):
        block = reader.span(reader.blocks.name(index))
        picks = []
        for layer in range(kv.layers):
            n = block.keys[layer].shape[1]
            heads = 1 if not per_head else kv.kv_heads
            picks.append(
                [
                    torch.randperm(n, generator=generator)[: max(1, round(shares[h] * n))]
                    .sort()
                    .values
                    for h in range(heads)
                ]
            )
        blocks.append(cut(block, picks, per_head))
    prefix, suffix = reader.span("prefix"), reader.span("suffix")
    header = reader.header
    if per_head:
        header = replace(header, kv=replace(kv, per_head=True))
        prefix, suffix = prefix.by_head(), suffix.by_head()
    write_pack(out, header, prefix, blocks, suffix, force=True)
    return out


def sizes(path: Path) -> dict:
    reader = PackReader(path)
    kv = reader.header.kv
    entries = int(reader.blocks.layer_totals().sum()) * (1 if kv.per_head else kv.kv_heads)
    stored = reader.stored_bytes(["blocks.k", "blocks.v", "blocks.pos"])
    kv_bytes = entries * 2 * kv.head_dim * torch.finfo(getattr(torch, kv.dtype)).bits // 8
    return {
        "entries": entries,
        "blocks_bytes": stored,
        "kv_bytes_held": kv_bytes,
        "bytes_per_kv_byte": round(stored / kv_bytes, 4),
    }


def ttfts(paths: dict[str, Path], backbone, rounds: int = 7) -> dict[str, dict]:
    """Each pack's median TTFT and phases, asked in turn round by round (no pack gains from going
    later), after one warm question each."""
    asked: dict[str, list] = {how: [] for how in paths}
    for path in paths.values():
        api.ask(path, QUESTION, ONE_TOKEN, backbone=backbone)
    for _ in range(rounds):
        for how, path in paths.items():
            asked[how].append(api.ask(path, QUESTION, ONE_TOKEN, backbone=backbone))
    return {
        how: {
            "ttft_s": round(statistics.median(a.ttft_s for a in answers), 4),
            "phases_s": {
                k: round(statistics.median(a.phases_s[k] for a in answers), 4)
                for k in answers[0].phases_s
            },
            "context_tokens": answers[0].context_tokens,
        }
        for how, answers in asked.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="rehearsal-llava-ov-0.5b")
    ap.add_argument("--layers", type=int, default=4, help="0: the model's full depth")
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--methods", default="", help="methods whose -per-layer preset to compare")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "per_head.json"))
    args = ap.parse_args()
    backbone = load_backbone(LoadOptions(args.model, args.device, layers=args.layers or None))
    with tempfile.TemporaryDirectory(prefix="mmkv-per-head-") as tmp:
        from mmkv_cli.study.synth import write_dataset

        write_dataset(Path(tmp) / "set", clips=1, frames=args.frames, seed=5, kind="normal")
        video = Path(tmp) / "set" / "clips" / "clip_0000.mp4"
        full = Path(tmp) / "full.kvpack"
        options = EncodeOptions("full", fps=2.0, max_frames=args.frames, force=True)
        api.encode(str(video), full, options, backbone=backbone)
        reader = PackReader(full)
        paths = {
            how: variant(reader, how, args.share, Path(tmp) / f"{how}.kvpack", seed=7)
            for how in ("per_layer", "per_head", "ragged")
        }
        for method in filter(None, args.methods.split(",")):
            for name in (method, f"{method}-per-layer"):
                made = EncodeOptions(name, args.share, fps=2.0, max_frames=args.frames, force=True)
                paths[name] = Path(tmp) / f"{name}.kvpack"
                api.encode(str(video), paths[name], made, backbone=backbone)
        timed = ttfts(paths, backbone)
        rows = {how: {**sizes(path), **timed[how]} for how, path in paths.items()}
        for how, row in rows.items():
            print(how, json.dumps(row), flush=True)

    def against(how: str) -> str:  # a method's rows against its -per-layer preset's
        method = how.removesuffix("-per-layer")
        return f"{method}-per-layer" if method in args.methods.split(",") else "per_layer"

    result = {
        "model": args.model,
        "layers": args.layers,
        "frames": args.frames,
        "share": args.share,
        "device": str(backbone.device),
        "rows": rows,
        "methods": args.methods,
        "figures": {
            how: {
                "against": against(how),
                "bytes_vs_per_layer_per_entry": round(
                    row["blocks_bytes"]
                    / row["entries"]
                    / (rows[against(how)]["blocks_bytes"] / rows[against(how)]["entries"]),
                    4,
                ),
                "bytes_vs_per_layer": round(
                    row["blocks_bytes"] / rows[against(how)]["blocks_bytes"], 4
                ),
                "ttft_vs_per_layer": round(row["ttft_s"] / rows[against(how)]["ttft_s"], 3),
            }
            for how, row in rows.items()
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["figures"], indent=1))


if __name__ == "__main__":
    main()
