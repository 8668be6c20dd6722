"""The host's share of an encode at real resolution: a video's sampled frames decoded and made RGB,
then prepared by the backbone's own video processor, as an encode's read-ahead does, against what
the device spends on a frame.

    python bench/media_prep.py [--sizes 1280x720,1920x1080] [--seconds 30] [--fps 2]
        [--threading SLICE,AUTO] [--models rehearsal-llava-ov-0.5b,rehearsal-qwen2.5-vl-3b]
        [--device cpu] [--out F]

The scale benchmark's clips are 128 px a side, whose decoding and resizing cost nothing; a user's
video is 720p or 1080p at 24-30 fps, every frame of it decoded, each sampled one converted to RGB
and resized to the tower's 384 or 392 px on the host. On a GPU that work runs beside the forward
on one thread (encode/stream.py), so it bounds the encode once it takes longer a frame than the
device's prefill of one (bench/gpu.py's floor part over its frames).

Read rows: seconds a sampled frame to decode and convert, for a file of one slice a frame (as the
ffmpeg command line and most encoders write) and one of several (PyAV's default), under each of
FFmpeg's decode threadings (`pyav_frames.DECODE_THREADING`). Prepare rows: seconds a frame for
each backbone's processor on the host and, where `--device` is a GPU, with its tensors on the
device (transformers' video processors take `device`): whether resizing there would pay.
Results: bench/results/media_prep.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CHUNK = 16  # frames a chunk, as an encode's default
# how the files are written: the encoder's threads decide the slices a frame
SLICES = {"one a frame": "FRAME", "several a frame": "SLICE"}


def read_row(video: Path, fps: float, threading: str) -> dict:
    """Every sampled frame of `video` read in chunks under `threading`."""
    from mmkv_cli.media import pyav_frames
    from mmkv_cli.media.video import load_video

    pyav_frames.DECODE_THREADING = threading
    load_video(video, fps, CHUNK).read(0, CHUNK)  # first calls
    media = load_video(video, fps, 0)
    started, cpu = time.perf_counter(), time.process_time()
    for first in range(0, media.num_frames, CHUNK):
        media.read(first, first + CHUNK)
    took = time.perf_counter() - started
    return {
        "frames": media.num_frames,
        "read_s_per_frame": took / media.num_frames,
        "cores_used": (time.process_time() - cpu) / took,
    }


def prepare_row(backbone, chunks: list, device) -> dict:
    """The backbone's own preparation of each chunk, its tensors made on `device` (None: the
    host's, as an encode prepares them now), every result waited for."""
    import torch

    def prepare(frames):
        if device is None:
            out = backbone.prepare(frames, None)
        else:
            out = backbone.video_processor(
                videos=[frames], return_tensors="pt", do_sample_frames=False, device=device
            )
        for value in out.values():
            if torch.is_tensor(value) and value.device.type == "cuda":
                torch.cuda.synchronize(value.device)

    prepare(chunks[0])  # first calls
    started = time.perf_counter()
    for frames in chunks:
        prepare(frames)
    frames = sum(len(c) for c in chunks)
    return {"frames": frames, "prepare_s_per_frame": (time.perf_counter() - started) / frames}


def main() -> None:
    from media_read import write_video

    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.media.video import load_video

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1280x720,1920x1080")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--fps", type=float, default=2.0, help="frames sampled a second")
    ap.add_argument("--threading", default="SLICE,AUTO", help="FFmpeg's decode threadings")
    ap.add_argument("--models", default="rehearsal-llava-ov-0.5b,rehearsal-qwen2.5-vl-3b")
    ap.add_argument("--device", default="cpu", help="where the processor's tensors also go")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "media_prep.json"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def keep(row: dict, work, *given) -> None:
        try:
            row.update(work(*given))
        except Exception as err:  # a device's processor failing leaves the other rows
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {"seconds": args.seconds, "fps": args.fps, "chunk": CHUNK, "rows": rows}
        out.write_text(json.dumps(result, indent=1) + "\n")

    backbones = {m: load_backbone(LoadOptions(m, "cpu", layers=1)) for m in args.models.split(",")}
    with tempfile.TemporaryDirectory(prefix="mmkv-prep-") as tmp:
        for size in args.sizes.split(","):
            width, height = (int(v) for v in size.split("x"))
            for slices, encoder in SLICES.items():
                video = Path(tmp) / f"{size}-{encoder}.mp4"
                write_video(video, width, height, args.seconds, encoder)
                for threading in args.threading.split(","):
                    row = {"size": size, "slices": slices, "decode_threading": threading}
                    keep(row, read_row, video, args.fps, threading)
            media = load_video(video, args.fps, 0)
            chunks = [media.read(f, f + CHUNK) for f in range(0, media.num_frames, CHUNK)]
            for model, backbone in backbones.items():
                for place in [None] + ([args.device] if args.device != "cpu" else []):
                    row = {"size": size, "model": model, "processor_on": place or "host"}
                    keep(row, prepare_row, backbone, chunks, place)


if __name__ == "__main__":
    main()
