"""Decode time per token and KV bytes after question-aware pruning at ask (issue 6), against the
full context.

    python bench/decode_cost.py [--frames 1024] [--budgets 1.0,0.5,0.1]
        [--methods aircache,snapkv,pyramidkv]

One full pack of a long synthetic clip (tiny backbone), then `ask --prune METHOD --budget B` for
each budget: decode seconds per token (median of --repeats rounds in shuffled order, 32 new tokens)
and the KV bytes the decode attends over. Goal: at 0.1, decode time <= 0.5x the unpruned ask.
Results: bench/results/decode_cost.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=1024)
    ap.add_argument("--budgets", default="1.0,0.5,0.1")
    ap.add_argument("--methods", default="aircache,snapkv,pyramidkv")
    ap.add_argument("--model", default="tiny-llava-ov")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
    from mmkv_cli.study.synth import write_dataset

    backbone = load_backbone(LoadOptions(args.model))
    kv = backbone.kv_shape()
    per_token = (
        2 * kv["kv_heads"] * kv["head_dim"] * (2 if kv["dtype"] in ("bfloat16", "float16") else 4)
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_dataset(Path(tmp) / "set", clips=1, frames=args.frames, seed=3, kind="normal")
        pack = Path(tmp) / "full.kvpack"
        video = str(Path(tmp) / "set" / "clips" / "clip_0000.mp4")
        api.encode(video, pack, EncodeOptions(max_frames=args.frames), backbone=backbone)

        configs = [("none", None, 1.0)] + [
            (m, m, float(b)) for m in args.methods.split(",") for b in args.budgets.split(",")
        ]
        times = {c: [] for c in configs}
        kept, generated = {}, {}
        # Every configuration once per round, in a fresh random order, rounds repeated: drift in the
        # machine's load, and whatever one ask leaves behind for the next, fall on all
        # configurations alike.
        shuffle = random.Random(0).shuffle
        for _ in range(args.repeats):
            order = list(configs)
            shuffle(order)
            for config in order:
                _, prune, budget = config
                asking = AskOptions(
                    prune=prune,
                    prune_budget=budget if prune else None,
                    generation=GenerationOptions(max_new_tokens=args.tokens),
                )
                answer = api.ask(pack, "which shape appeared first ?", asking, backbone=backbone)
                times[config].append(answer.decode_s_per_token)
                kept[config] = answer.kv_tokens or [answer.context_tokens] * kv["layers"]
                generated[config] = len(answer.token_ids)
        base = statistics.median(times[configs[0]])
        for config in configs:
            label, _, budget = config
            t = statistics.median(times[config])
            rows.append(
                {
                    "method": label,
                    "budget": budget,
                    "decode_s_per_token": t,
                    "kv_bytes": sum(kept[config]) * per_token,
                    "tokens_generated": generated[config],
                    "ratio": t / base,
                }
            )
            print(
                f"{label:10s} {budget:4.2f}: {1000 * t:.2f} ms/token ({t / base:.2f}x), "
                f"KV {sum(kept[config]) * per_token / 2**20:.2f} MiB",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode_cost.json").write_text(
        json.dumps(
            {
                "model": args.model,
                "frames": args.frames,
                "device": str(backbone.device),
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
