"""Encode cost of the reducer rows of docs/eval-demo.md on the demo-grid backbone: every clip of a
synthetic set encoded whole, once per row, one process, nothing else running; the mean encode
seconds, the share of tokens prefilled and the pack's KV bytes.

    mmkv synth /tmp/g64r --world grid --clips 24 --frames 64 --seed 2070
    python bench/reduce_grid.py /tmp/g64r

Writes bench/results/reduce-demo-grid.json. The eval's own encode times (the stream protocol
spreads an encode over its moments) are not comparable; these are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (method, reducer, budget share): None keeps the method's own
ROWS = [
    ("full", None, None),
    ("streamingtom", None, None),
    ("rekv", None, None),
    ("rekv", "dtd", None),
    ("hermes", None, 0.5),
    ("hermes", "dtd", 0.5),
    ("hermes", None, 0.1),
    ("hermes", "dtd", 0.1),
    ("streammem", None, 0.5),
    ("streammem", None, 0.1),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("set", type=Path)
    parser.add_argument("--model", default="demo-grid")
    args = parser.parse_args()

    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import EncodeOptions, LoadOptions

    backbone = load_backbone(LoadOptions(args.model, "cpu"))
    clips = sorted((args.set / "clips").glob("*.mp4"))
    out = {"model": args.model, "set": str(args.set), "clips": len(clips), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "p.kvpack"
        api.encode(str(clips[0]), pack, EncodeOptions(force=True), backbone=backbone)  # warm-up
        for method, reduce, share in ROWS:
            done = [
                api.encode(
                    str(clip),
                    pack,
                    EncodeOptions(method, share, force=True, reduce=reduce),
                    backbone=backbone,
                )
                for clip in clips
            ]
            row = {
                "method": method,
                "reduce": reduce,
                "budget": share,
                "encode_s": statistics.mean(d["encode_s"] for d in done),
                "prefilled": statistics.mean(
                    d["visual_tokens_prefilled"] / d["visual_tokens_total"] for d in done
                ),
                "kept": statistics.mean(d["visual_kv_share"] for d in done),
                "kv_bytes": statistics.mean(d["kv_bytes"] for d in done),
                "kv_bits": done[0]["kv_bits"],
            }
            out["rows"].append(row)
            print(row, flush=True)
    full = out["rows"][0]
    for row in out["rows"]:
        row["encode_over_full"] = row["encode_s"] / full["encode_s"]
        row["kv_over_full"] = row["kv_bytes"] / full["kv_bytes"]
    target = ROOT / "bench" / "results" / "reduce-demo-grid.json"
    target.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
