"""What `--checkpoint-every` costs an encode at real width: bytes written to disk, the disk the
checkpoint holds at its largest, and encode time, against the same encode without checkpoints.

    python bench/checkpoint_writes.py [--model rehearsal-llava-ov-0.5b] [--layers 1]
        [--frames 64,256] [--methods full,recency,h2o,hermes,rekv,mukv] [--every 1]

Each (method, frames) runs in its own process, which encodes the stream twice with one backbone:
without checkpoints, then saving every --every chunks. The bytes written are the process's own
(/proc/self/io wchar), so the checkpoint's are the difference between the two encodes (both write
the pack). A thread samples the checkpoint's files on disk every 10 ms for their peak. Figures:
  written / pack   checkpoint bytes written over the whole encode / the pack's bytes: flat in the
                   stream's length when each save writes only what is new; it grows with the
                   length when saves rewrite what they saved before
  disk / pack      the checkpoint files' peak on disk / the pack's bytes
  slowdown         encode time with checkpoints / without
Writes bench/results/checkpoint_writes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUADRATIC = {"full", "snapkv", "h2o", "pyramidkv", "meda", "aircache"}

CHILD = r"""
import json, sys, threading, time
from pathlib import Path
from mmkv_cli import api
from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.encode.checkpoint import checkpoint_path
from mmkv_cli.core.options import EncodeOptions, LoadOptions
video, pack, model, layers, method, frames, every = sys.argv[1:8]
pack = Path(pack)
backbone = load_backbone(LoadOptions(model, "cpu", layers=int(layers) or None))

def written() -> int:
    line = next(l for l in Path("/proc/self/io").read_text().splitlines() if l.startswith("wchar"))
    return int(line.split()[1])

def encode(every: int) -> tuple[dict, int]:
    options = EncodeOptions(method, fps=2.0, max_frames=int(frames), force=True,
                            checkpoint_every=every)
    before = written()
    info = api.encode(video, pack, options, backbone=backbone)
    return info, written() - before

api.encode(video, pack, EncodeOptions(method, fps=2.0, max_frames=16, force=True),
           backbone=backbone)  # warm: first-call allocations and imports are no one's cost
plain, plain_written = encode(0)
head = checkpoint_path(pack)
peak, done = [0], threading.Event()

def sample():
    while not done.is_set():
        size = 0
        for found in pack.parent.glob(head.name + "*"):
            try:
                size += found.stat().st_size
            except FileNotFoundError:  # swept between the listing and the stat
                pass
        peak[0] = max(peak[0], size)
        time.sleep(0.01)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
saved, saved_written = encode(int(every))
done.set()
sampler.join()
print(json.dumps({
    "method": method, "frames": int(frames), "tokens": plain["visual_tokens_total"],
    "pack_bytes": plain["bytes"], "checkpoint_written": saved_written - plain_written,
    "checkpoint_peak_disk": peak[0],
    "encode_s": plain["encode_s"], "encode_checkpointed_s": saved["encode_s"],
}))
"""


def run_one(video: Path, work: Path, args, method: str, frames: int) -> dict | None:
    pack = work / f"{method}-{frames}.kvpack"
    cmd = [sys.executable, "-c", CHILD, str(video), str(pack), args.model, str(args.layers)]
    cmd += [method, str(frames), str(args.every)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    pack.unlink(missing_ok=True)
    if done.returncode != 0:
        print(f"{method} {frames}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["written_over_pack"] = row["checkpoint_written"] / row["pack_bytes"]
    row["disk_over_pack"] = row["checkpoint_peak_disk"] / row["pack_bytes"]
    row["slowdown"] = row["encode_checkpointed_s"] / row["encode_s"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="rehearsal-llava-ov-0.5b")
    ap.add_argument("--layers", type=int, default=1, help="0: the model's full depth")
    ap.add_argument("--frames", default="64,256")
    ap.add_argument("--methods", default="full,recency,h2o,hermes,rekv,mukv")
    ap.add_argument("--every", type=int, default=1, help="chunks between saves")
    ap.add_argument("--quadratic-tokens", type=int, default=60000)
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_writes.json"))
    args = ap.parse_args()
    frames = [int(f) for f in args.frames.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmkv-ckpt-") as tmp:
        from mmkv_cli.study.synth import write_dataset

        write_dataset(Path(tmp) / "set", clips=1, frames=max(frames), seed=5, kind="normal")
        video = Path(tmp) / "set" / "clips" / "clip_0000.mp4"
        for f in frames:
            for method in args.methods.split(","):
                if method in QUADRATIC and f * 196 > args.quadratic_tokens:
                    continue
                row = run_one(video, Path(tmp), args, method, f)
                if row:
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    result = {"model": args.model, "layers": args.layers, "every": args.every, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(
            f"{r['method']:>8} {r['frames']:>5} frames: written/pack {r['written_over_pack']:.2f}"
            f"  disk/pack {r['disk_over_pack']:.2f}  slowdown {r['slowdown']:.2f}"
        )


if __name__ == "__main__":
    main()
