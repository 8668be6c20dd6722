"""HERMES encode memory does not grow with the video: peak RSS and peak KV of one encode per clip
length.

    python bench/hermes_memory.py [--frames 64,1024] [--budget-tokens 512] [--model tiny-llava-ov]

Every encode runs in its own process (peak RSS is per process), on synthetic clips written by `mmkv
synth`. Goal (issue 5): peak RSS at 1024 frames <= 1.2x that at 64 frames. Results:
bench/results/hermes_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

CHILD = """
import json, resource, sys
from mmkv_cli import api
from mmkv_cli.core.options import EncodeOptions, LoadOptions
video, out, model, method, budget_tokens = sys.argv[1:6]
tokens = int(budget_tokens) if method.startswith("hermes") else None
options = EncodeOptions(method, budget_tokens=tokens, max_frames=100000, force=True)
info = api.encode(video, out, options, load=LoadOptions(model, "cpu"))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({"peak_rss": peak, "peak_kv": info["peak_kv_bytes"], "encode_s": info["encode_s"],
                  "kept": info["visual_tokens_kept"], "total": info["visual_tokens_total"]}))
"""


def measure(video: Path, model: str, method: str, budget_tokens: int, work: Path) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(video),
            str(work / "out.kvpack"),
            model,
            method,
            str(budget_tokens),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"encode failed: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", default="64,1024")
    ap.add_argument("--budget-tokens", type=int, default=512)
    ap.add_argument("--model", default="tiny-llava-ov")
    ap.add_argument("--methods", default="hermes,full")
    args = ap.parse_args()
    from mmkv_cli.study.synth import write_dataset

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for frames in [int(f) for f in args.frames.split(",")]:
            folder = work / f"f{frames}"
            write_dataset(folder, clips=1, frames=frames, seed=1, kind="normal")
            for method in args.methods.split(","):
                result = measure(
                    folder / "clips" / "clip_0000.mp4", args.model, method, args.budget_tokens, work
                )
                rows.append({"frames": frames, "method": method, **result})
                print(
                    f"{method:8s} {frames:5d} frames: "
                    f"peak RSS {result['peak_rss'] / 2**20:7.1f} MiB, "
                    f"peak KV {result['peak_kv'] / 2**20:6.2f} MiB, "
                    f"kept {result['kept']}/{result['total']}, "
                    f"{result['encode_s']:.1f}s",
                    flush=True,
                )
    frames = sorted({r["frames"] for r in rows})
    for method in args.methods.split(","):
        rss = {r["frames"]: r["peak_rss"] for r in rows if r["method"] == method}
        print(
            f"{method}: peak RSS {frames[-1]} / {frames[0]} frames = "
            f"{rss[frames[-1]] / rss[frames[0]]:.2f}x"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hermes_memory.json").write_text(
        json.dumps(
            {"model": args.model, "budget_tokens": args.budget_tokens, "rows": rows}, indent=1
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
