"""Encode cost with token reducers at real width: encode time / plain full prefill of the same
stream (P3), tokens prefilled, KV kept and pack size, on a still clip and a busy one.

    python bench/reduce.py [--model rehearsal-llava-ov-0.5b] [--layers 1] [--frames 128]
        [--device auto]

A rehearsal backbone has the real language model's width and 196 tokens a frame, random weights
and a cheap tower; on a CPU it runs at reduced depth (--layers), where the language model's prefill
is what a reducer saves. The still clip is one scene with a little sensor noise and one small shape
crossing it (a few patches change a frame); the busy one pans the background 16 px and changes
every block's colour every frame. Every row is one encode in this process (the fastest of
`--repeats`), after a warm-up encode of 8 frames of each row's method and reducer: on an H100 the
first encode through a path paid its first calls, and a plain encode timed first in the process
took 3.2 s where the same after the others took 1.9. The plain prefill is `full` without a reducer.
Writes bench/results/reduce.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SIDE = 384
# (method, reducer, budget tokens): None keeps the method's own
ROWS = [
    ("full", None, None),
    ("full", "dtd", None),
    ("full", "ctr", None),
    ("full", "visionzip", None),
    ("streamingtom", None, None),
    ("hermes", None, 4096),
    ("hermes", "dtd", 4096),
    ("rekv", None, None),
    ("rekv", "dtd", None),
    ("streammem", None, 4096),
]


def still_clip(frames: int, seed: int = 0) -> np.ndarray:
    """One scene (blocks of colour), sensor noise, and a 48 px shape crossing it 6 px a frame."""
    rng = np.random.default_rng(seed)
    scene = np.kron(rng.integers(40, 220, (12, 12, 3)), np.ones((32, 32, 1))).astype(np.int16)
    out = np.clip(scene[None] + rng.integers(-2, 3, (frames, SIDE, SIDE, 3)), 0, 255)
    for f in range(frames):
        x = (f * 6) % (SIDE - 48)
        out[f, 168:216, x : x + 48] = (250, 250, 250)
    return out.astype(np.uint8)


def busy_clip(frames: int, seed: int = 1) -> np.ndarray:
    """Every frame different: the background pans 16 px a frame and the blocks change colour."""
    rng = np.random.default_rng(seed)
    wide = np.kron(rng.integers(40, 220, (12, 12 + frames, 3)), np.ones((32, 32, 1)))
    out = np.empty((frames, SIDE, SIDE, 3), dtype=np.uint8)
    for f in range(frames):
        view = wide[:, f * 16 : f * 16 + SIDE]
        out[f] = (view + rng.integers(-40, 41, (12, 12, 3)).repeat(32, 0).repeat(32, 1)).clip(
            0, 255
        )
    return out


def encode_row(api, backbone, video: Path, pack: Path, method, reduce, budget_tokens, frames):
    from mmkv_cli.core.options import EncodeOptions

    options = EncodeOptions(
        method,
        budget_tokens=budget_tokens,
        fps=2.0,
        max_frames=frames,
        force=True,
        reduce=reduce,
    )
    started = time.perf_counter()
    info = api.encode(str(video), pack, options, backbone=backbone)
    return info, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="rehearsal-llava-ov-0.5b")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", help="results file (default: bench/results/reduce-MODEL-Nl.json)")
    parser.add_argument("--repeats", type=int, default=1, help="encodes a row, the fastest kept")
    args = parser.parse_args()

    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.study.synth import write_video

    backbone = load_backbone(LoadOptions(args.model, args.device, layers=args.layers or None))
    out = {"model": args.model, "layers": args.layers, "frames": args.frames, "clips": {}}
    out["device"] = str(backbone.device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, make in (("still", still_clip), ("busy", busy_clip)):
            video = work / f"{name}.mp4"
            write_video(video, make(args.frames), 2.0)
            pack = work / "p.kvpack"
            if name == "still":  # each row's path once, so no row pays its first calls
                for method, reduce, budget_tokens in ROWS:
                    encode_row(api, backbone, video, pack, method, reduce, budget_tokens, 8)
            rows = []
            for method, reduce, budget_tokens in ROWS:
                info, wall = min(
                    (
                        encode_row(
                            api, backbone, video, pack, method, reduce, budget_tokens, args.frames
                        )
                        for _ in range(max(1, args.repeats))
                    ),
                    key=lambda done: done[0]["encode_s"],
                )
                rows.append(
                    {
                        "method": method,
                        "reduce": info["reduce"],
                        "encode_s": info["encode_s"],
                        "wall_s": wall,
                        "tokens": info["visual_tokens_total"],
                        "prefilled": info["visual_tokens_prefilled"],
                        "kept": info["visual_tokens_kept"],
                        "kv_bits": info["kv_bits"],
                        "kv_bytes": info["kv_bytes"],
                        "bytes": info["bytes"],
                    }
                )
                print(name, rows[-1], flush=True)
            full = rows[0]
            # full's KV as fp16 (a CPU rehearsal computes in float32)
            fp16 = full["kv_bytes"] * 2 / {"float32": 4}.get(backbone.kv_shape()["dtype"], 2)
            for row in rows:
                row["encode_over_prefill"] = row["encode_s"] / full["encode_s"]
                row["prefilled_share"] = row["prefilled"] / row["tokens"]
                row["kv_over_full"] = row["kv_bytes"] / full["kv_bytes"]
                row["kv_over_full_fp16"] = row["kv_bytes"] / fp16
            out["clips"][name] = rows
    RESULTS.mkdir(exist_ok=True)
    target = Path(args.out) if args.out else RESULTS / f"reduce-{args.model}-{args.layers}l.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    for clip, rows in out["clips"].items():
        for r in rows:
            print(
                f"{clip:5} {r['method']:12} {str(r['reduce']):9} P3 {r['encode_over_prefill']:.2f} "
                f"prefilled {r['prefilled_share']:.3f} KV/full fp16 {r['kv_over_full_fp16']:.4f}"
            )


if __name__ == "__main__":
    main()
