"""What following a live stream costs: real-time factor, a question's time to first token while the
stream runs against the encode idle, and peak memory of a long stream against a short one.

    python bench/live.py [--model demo] [--methods hermes,infinipot,recency] [--tokens 64]
        [--minutes 1,30] [--fps 1] [--layers N]

Each (method, minutes) runs in its own process (peak RSS is per process): synthetic frames at --fps
pushed into the live encoder as fast as it takes them; every minute of stream a question is answered
from the memory then, in place (a fork of the state, the answer's first token: what `mmkv live`
does), and the same question from the pack of that memory, written and opened afresh
(`pack_ttft_s`: its open and first token, not the write); the memory is then cut once more at the
same moment (`snapshot_again_s`: what the first cut paid for being first shows as the
difference). Goals: peak RSS of 30 minutes / 1 minute
<= 1.2 for hermes, infinipot and recency (issue 36); the in-place TTFT <= 1.2x the pack's (50).
Results: bench/results/live.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUESTION = "what color is the circle ?"


def child(
    model: str, method: str, tokens: int, minutes: float, fps: float, layers: int, device: str
) -> dict:
    """One stream, in this process: synthetic frames pushed as fast as the encoder takes them."""
    import resource
    import tempfile
    import time

    import numpy as np

    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import AskOptions, GenerationOptions, LoadOptions
    from mmkv_cli.encode.live import LiveEncoder
    from mmkv_cli.encode.record import pack_header, write_encoded
    from mmkv_cli.media.base import Media
    from mmkv_cli.methods import EncodeContext
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.pack.access.memory import MemoryPack

    backbone = load_backbone(LoadOptions(model, device, layers=layers or None))
    choice = resolve_method(method)
    if choice.method.takes_budget:
        choice = choice.with_budget(tokens=tokens)
    context = EncodeContext("video")
    live = LiveEncoder(backbone, choice, context)
    rng = np.random.default_rng(0)
    frames = int(minutes * 60 * fps)
    asking = AskOptions(generation=GenerationOptions(1))
    encode_s, asks, per_minute = 0.0, [], [0.0] * max(1, int(minutes + 0.999))
    with tempfile.TemporaryDirectory() as work:
        pack = Path(work) / "now.kvpack"
        for i in range(frames):
            frame = rng.integers(0, 255, size=(128, 128, 3), dtype=np.uint8)
            started = time.perf_counter()
            live.push(frame, i / fps)
            encode_s += time.perf_counter() - started
            per_minute[int(i / fps // 60)] += time.perf_counter() - started
            if (i + 1) % int(60 * fps):
                continue
            started = time.perf_counter()  # a question every minute of stream
            memory = live.memory()
            cut = Media("video", "bench", "-", list(live.times), None)
            header, _ = pack_header(backbone, choice, context, cut, memory)
            held = MemoryPack(header, memory.prefix, memory.blocks, memory.suffix,
                              memory.representatives)  # fmt: skip
            snapshot = time.perf_counter() - started
            answer = api.PackSession(held, backbone=backbone).ask(QUESTION, asking)
            in_place = time.perf_counter() - started
            started = time.perf_counter()  # the same cut again: what a first call alone paid
            live.memory()
            again = time.perf_counter() - started
            write_encoded(pack, backbone, choice, context, cut, memory, force=True)
            started = time.perf_counter()
            api.ask(pack, QUESTION, asking, backbone=backbone)
            asks.append(
                {
                    "snapshot_s": snapshot,
                    "snapshot_again_s": again,
                    "ttft_s": snapshot + answer.ttft_s,
                    "answer_s": in_place,
                    "pack_ttft_s": time.perf_counter() - started,
                }
            )
    return {
        "frames": frames,
        "encode_s": encode_s,
        # seconds of encode each minute of stream: a chunk late in an hour should cost what one
        # early does (the first minute fills a fixed memory, so the second is the fair one)
        "encode_s_per_minute": per_minute,
        "real_time_factor": frames / fps / max(encode_s, 1e-9),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "asks": asks,
        "chunk_frames": live.chunk_size,
    }


def run(
    model: str, method: str, tokens: int, minutes: float, fps: float, layers: int, device: str
) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", model, method, str(tokens), str(minutes), str(fps)]
        + [str(layers), device],
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": python_path()},
    )
    if done.returncode:
        raise SystemExit(f"{method} {minutes} min failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def python_path() -> str:
    """The repository, then what the caller's PYTHONPATH named (packages carried to a machine)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def minutes_ratio(got: dict, minute: int) -> float:
    """The last whole minute's encode time over minute `minute`'s (nan without both)."""
    spent = got["encode_s_per_minute"]
    return spent[-1] / spent[minute] if len(spent) > minute + 1 and spent[minute] else float("nan")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        model, method, tokens, minutes, fps, layers, device = sys.argv[2:9]
        got = child(model, method, int(tokens), float(minutes), float(fps), int(layers), device)
        print(json.dumps(got))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--methods", default="hermes,infinipot,recency")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--minutes", default="1,30")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=0, help="cut a rehearsal model (0: all)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    minutes = [float(m) for m in args.minutes.split(",")]
    rows = []
    for method in args.methods.split(","):
        for length in minutes:
            got = run(args.model, method, args.tokens, length, args.fps, args.layers, args.device)
            ttft = [a["ttft_s"] for a in got["asks"]]
            # both need the memory cut; after it, asking in place against asking its pack
            ratio = [(a["ttft_s"] - a["snapshot_s"]) / a["pack_ttft_s"] for a in got["asks"]]
            rows.append({"method": method, "minutes": length, **got})
            print(
                f"{method:10s} {length:5g} min: {got['real_time_factor']:7.1f}x real time, "
                f"peak RSS {got['peak_rss'] / 2**20:7.1f} MiB, "
                f"TTFT {min(ttft):.3f}-{max(ttft):.3f} s over {len(ttft)} questions, "
                f"in place / pack {min(ratio):.2f}-{max(ratio):.2f}, "
                f"encode of the last minute / first {minutes_ratio(got, 0):.2f}, "
                f"/ second {minutes_ratio(got, 1):.2f}",
                flush=True,
            )
        if len(minutes) > 1:
            short, long = rows[-len(minutes)], rows[-1]
            print(
                f"{method}: peak RSS {long['minutes']:g} / {short['minutes']:g} min = "
                f"{long['peak_rss'] / short['peak_rss']:.3f}"
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"live-{args.model}{f'-{args.layers}l' if args.layers else ''}.json"
    out.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
