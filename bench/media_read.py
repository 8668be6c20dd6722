"""Video readers at real resolution: what reading a video's sampled frames costs in memory and time.

    python bench/media_read.py [--size 1280x720] [--seconds 60] [--fps 2,30]
        [--backends pyav,decord]

Writes an H.264 video (30 fps, a key frame every 2 s, B-frames) of moving gradients, then for each
backend and sampling rate reads every sampled frame in chunks of 16, as an encode does, each in its
own process. Reports the open time, the read rate and the RSS the reader adds over the process's
baseline (imports done): a streaming reader holds one chunk, whatever the video's length. Results:
bench/results/media_read.json.
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

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
import numpy as np
from mmkv_cli.media.video import import_decord, load_video
path, backend, fps = sys.argv[1], sys.argv[2], float(sys.argv[3])
import av
if backend == "decord":
    import_decord()
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
baseline = rss()
started = time.perf_counter()
media = load_video(Path(path), fps, 0, backend=backend)
opened = time.perf_counter() - started
checksum = 0
for first in range(0, media.num_frames, 16):
    checksum += int(media.read(first, first + 16)[:, ::97, ::97].sum())
total = time.perf_counter() - started
print(json.dumps({"backend": backend, "fps": fps, "frames": media.num_frames, "open_s": opened,
                  "read_fps": media.num_frames / (total - opened), "added_rss": rss() - baseline,
                  "checksum": checksum}))
"""


def write_video(
    path: Path, width: int, height: int, seconds: int, encoder_threads: str = "SLICE"
) -> None:
    """encoder_threads: PyAV's default "SLICE" writes several slices a frame; "FRAME" one, as the
    ffmpeg command line and most encoders do (only frame threads decode those in parallel)."""
    import av
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    # each channel's gradient once, moved by adding to bytes (which wrap at 256, as the % did)
    base = np.stack([x % 256, y % 256, ((x + y) // 2) % 256], axis=-1).astype(np.uint8)
    steps = np.array([3, 2, 1], dtype=np.int64)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_type = encoder_threads
        stream.options = {"g": "60", "bf": "2", "preset": "ultrafast", "crf": "23"}
        for i in range(seconds * 30):
            image = base + ((steps * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--fps", default="2,30", help="sampling rates to read at")
    ap.add_argument("--backends", default="pyav,decord")
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmkv-media-") as tmp:
        video = Path(tmp) / "video.mp4"
        write_video(video, width, height, args.seconds)
        for fps in args.fps.split(","):
            for backend in args.backends.split(","):
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, str(video), backend, fps],
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                )
                if done.returncode != 0:
                    print(f"{backend} at {fps} fps failed: {done.stderr.strip()[-300:]}")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                added = row["added_rss"] / 2**20
                print(
                    f"{backend:6s} {row['frames']:5d} frames ({fps} fps): open {row['open_s']:.2f}s"
                    f", read {row['read_fps']:.0f} frames/s, adds {added:.0f} MiB",
                    flush=True,
                )
    frame_bytes = width * height * 3
    result = {
        "size": [width, height],
        "seconds": args.seconds,
        "frame_bytes": frame_bytes,
        "rows": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "media_read.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
