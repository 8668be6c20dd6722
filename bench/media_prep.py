"""The host's share of an encode at real resolution: a video's sampled frames decoded, made RGB and
prepared by the backbone's own video processor, as an encode's read-ahead does, against what the
device spends on a frame.

    python bench/media_prep.py [--sizes 1280x720,1920x1080] [--seconds 30] [--fps 2]
        [--models rehearsal-llava-ov-0.5b,rehearsal-qwen2.5-vl-3b] [--device cpu] [--out F]

The scale benchmark's clips are 128 px a side, whose decoding and resizing cost nothing; a user's
video is 720p or 1080p at 24-30 fps, every frame of it decoded, each sampled one converted to RGB
and resized to the tower's 384 or 392 px on the host. On a GPU that work runs beside the forward
on one thread (encode/stream.py), so it bounds the encode once it takes longer a frame than the
device's prefill of one (bench/gpu.py's floor part over its frames). Each row reports seconds a
frame for the read (decode and RGB) and for the processor, on the host and, where `--device` is
a GPU, with the processor's tensors on the device (transformers' video processors take `device`):
whether moving the resize there would pay. Results: bench/results/media_prep.json.
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


def timed_chunks(media, prepare) -> tuple[float, float, int]:
    """(read seconds, prepare seconds, frames) over every chunk of `media`."""
    read_s = prepare_s = 0.0
    for first in range(0, media.num_frames, CHUNK):
        started = time.perf_counter()
        frames = media.read(first, first + CHUNK)
        read_s += time.perf_counter() - started
        started = time.perf_counter()
        prepare(frames)
        prepare_s += time.perf_counter() - started
    return read_s, prepare_s, media.num_frames


def processor_on(backbone, device):
    """The backbone's own preparation of a chunk, its tensors made on `device` (None: the host's,
    as an encode prepares them now), every result waited for."""
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
        return out

    return prepare


def main() -> None:
    from media_read import write_video

    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.options import LoadOptions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1280x720,1920x1080")
    ap.add_argument("--seconds", type=int, default=30)
    ap.add_argument("--fps", type=float, default=2.0, help="frames sampled a second")
    ap.add_argument("--models", default="rehearsal-llava-ov-0.5b,rehearsal-qwen2.5-vl-3b")
    ap.add_argument("--device", default="cpu", help="where the processor's tensors also go")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "media_prep.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mmkv-prep-") as tmp:
        for size in args.sizes.split(","):
            width, height = (int(v) for v in size.split("x"))
            video = Path(tmp) / f"{size}.mp4"
            write_video(video, width, height, args.seconds)
            for model in args.models.split(","):
                backbone = load_backbone(LoadOptions(model, "cpu", layers=1))
                for place in [None] + ([args.device] if args.device != "cpu" else []):
                    row = {"size": size, "model": model, "processor_on": place or "host"}
                    try:
                        row.update(measured(backbone, video, args.fps, place))
                    except Exception as err:  # a device's processor failing leaves the rest
                        row["error"] = f"{type(err).__name__}: {err}"[:300]
                    rows.append(row)
                    print(line(row), flush=True)
                    result = {"seconds": args.seconds, "fps": args.fps, "chunk": CHUNK}
                    out.write_text(json.dumps({**result, "rows": rows}, indent=1) + "\n")


def measured(backbone, video: Path, fps: float, place) -> dict:
    """A row's figures: every chunk of the video read and prepared, after one chunk's first
    calls."""
    from mmkv_cli.media.video import load_video

    prepare = processor_on(backbone, place)
    prepare(load_video(video, fps, CHUNK).read(0, CHUNK))
    read_s, prepare_s, frames = timed_chunks(load_video(video, fps, 0), prepare)
    return {
        "frames": frames,
        "read_s_per_frame": read_s / frames,
        "prepare_s_per_frame": prepare_s / frames,
        "host_frames_per_s": frames / (read_s + prepare_s),
    }


def line(row: dict) -> str:
    where = f"{row['size']} {row['model']} processor on {row['processor_on']}"
    if "error" in row:
        return f"{where}: {row['error']}"
    return (
        f"{where}: read {row['read_s_per_frame'] * 1e3:.1f} ms, prepare "
        f"{row['prepare_s_per_frame'] * 1e3:.1f} ms a frame ({row['host_frames_per_s']:.0f} "
        "frames/s)"
    )


if __name__ == "__main__":
    main()
