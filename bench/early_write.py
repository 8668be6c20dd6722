"""Writing a pack while it is encoded (issue 48, item 3): what an encode of a method that keeps
every token costs after its last chunk, with the pack written at the end against written as the
chunks go in (pack/access/early.py).

    python bench/early_write.py [--model rehearsal-llava-ov-0.5b] [--layers 4] [--frames 128]
        [--device auto] [--repeats 2] [--methods full,rekv]
        [--out bench/results/early_write-cpu.json]

For each method (full and rekv; streamingtom's 4-bit pack is quantized by the writer), each way in
turn: the encode's wall time (api.encode: media to a published,
fsync'd pack), the encode's own time (up to the suffix's prefill), and their difference, the tail:
what the write adds after the last chunk. Best of `repeats`. The early write is forced on whatever
the pack's size and device (by default it needs 64 MiB of K/V and a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mmkv_cli.encode.sealing as sealing  # noqa: E402
import mmkv_cli.pack.access.early as early  # noqa: E402
from mmkv_cli import api  # noqa: E402
from mmkv_cli.backbones.loading import load_backbone  # noqa: E402
from mmkv_cli.core.options import EncodeOptions, LoadOptions  # noqa: E402


def encode_once(backbone, video: Path, pack: Path, method: str, frames: int, when: str) -> dict:
    worth = early.worth_writing_early
    sealing.worth_writing_early = (lambda *_: True) if when == "early" else (lambda *_: False)
    sealing.ON_CPU = True  # measured here on the CPU too (by default a CPU writes at the end)
    try:
        started = time.perf_counter()
        done = api.encode(
            str(video),
            pack,
            EncodeOptions(method, max_frames=frames, fps=2.0, force=True),
            backbone=backbone,
        )
        wall = time.perf_counter() - started
    finally:
        sealing.worth_writing_early = worth
    return {"wall_s": wall, "encode_s": done["encode_s"], "tail_s": wall - done["encode_s"],
            "pack_bytes": pack.stat().st_size}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="rehearsal-llava-ov-0.5b")
    ap.add_argument("--layers", type=int, default=4, help="0: the model's full depth")
    ap.add_argument("--frames", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", default="full,rekv", help="methods that keep every token")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "early_write-cpu.json"))
    args = ap.parse_args()
    backbone = load_backbone(LoadOptions(args.model, args.device, layers=args.layers or None))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        from mmkv_cli.study.synth import write_dataset

        write_dataset(Path(tmp) / "set", clips=1, frames=args.frames, seed=5, kind="normal")
        video = next((Path(tmp) / "set").rglob("*.mp4"))
        for method in args.methods.split(","):
            runs: dict[str, list[dict]] = {"end": [], "early": []}
            for _ in range(args.repeats):
                for when in runs:  # in turn: the page cache and the machine alike for both
                    pack = Path(tmp) / f"{method}-{when}.kvpack"
                    runs[when].append(encode_once(backbone, video, pack, method, args.frames, when))
                    pack.unlink()
            for when, measured in runs.items():
                best = min(measured, key=lambda r: r["wall_s"])
                row = {"method": method, "written": when, **best}
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"model": args.model, "layers": args.layers, "frames": args.frames,
              "device": str(backbone.device), "cpus": os.cpu_count(), "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
