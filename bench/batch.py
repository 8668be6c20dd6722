"""Scale-out (issue 17): batch throughput in-process and on Ray, and asking packs held in S3.

    python bench/batch.py [--items 8] [--frames 32] [--layers 2] [--ask-frames 1024] [--skip-ask]

1. Batch: --items synthetic clips of --frames frames (2 fps), encoded with `full` by the
   rehearsal LLaVA-OV-0.5B (real width, 196 tokens a frame, --layers of its 24 layers) on this
   CPU: in-process (torch on every core), on a local Ray with 1 worker given every core, and with
   2 workers of one core each. Each in a fresh process timed start to exit (imports, Ray's start,
   backbone loads included): items a minute, and Ray's overhead over the in-process loop with one
   worker, for the whole command and per item once running (the ledger's item seconds).
2. Ask from S3: a --ask-frames-frame MuKV pack (same model, 1 layer) uploaded to moto's S3 server
   on loopback. For each question, a fresh session: bytes fetched / pack size, and the TTFT of the
   ask from S3 / from the local file (the pack opened, header and table read, before the clock
   starts for both).
Writes bench/results/batch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmkv_cli import api  # noqa: E402
from mmkv_cli.batch.driver import run_batch  # noqa: E402
from mmkv_cli.batch.manifest import read_manifest  # noqa: E402
from mmkv_cli.batch.run import BatchSettings  # noqa: E402
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions  # noqa: E402
from mmkv_cli.study.synth import write_dataset  # noqa: E402

MODEL = "rehearsal-llava-ov-0.5b"
QUESTIONS = [
    "what happened first ?",
    "which shape appeared last ?",
    "what color is the circle ?",
    "how many times did the star appear ?",
    "where was the square at the end ?",
]


RUNS = {  # mode -> (ray address, workers, CPUs a worker; 0: every core)
    "in-process": (None, 1, 0),
    "ray-1": ("local", 1, 0),
    "ray-2": ("local", 2, 1),
}


def one_batch(mode: str, clips: Path, dest: Path, args) -> list[dict]:
    """One batch, in this (fresh) process: what `mmkv batch` does from the command line."""
    ray, workers, cpus = RUNS[mode]
    load = LoadOptions(MODEL, "cpu", "bfloat16", layers=args.layers)
    options = EncodeOptions("full", fps=2.0, max_frames=args.frames)
    return run_batch(
        read_manifest(str(clips)),
        BatchSettings(load, options, str(dest)),
        ray=ray,
        workers=workers,
        cpus_per_worker=cpus or (os.cpu_count() or 1),
    )


def batch_runs(work: Path, args) -> list[dict]:
    """Each mode in a fresh process, timed from its start to its exit: imports, Ray's start and
    the backbone loads are paid as a user of the command pays them."""
    write_dataset(work / "set", clips=args.items, frames=args.frames, seed=17, kind="normal")
    out = []
    for mode in RUNS:
        dest = work / mode
        command = [sys.executable, __file__, "--one", mode, "--clips", str(work / "set" / "clips")]
        command += ["--dest", str(dest), "--frames", str(args.frames), "--layers", str(args.layers)]
        started = time.perf_counter()
        subprocess.run(command, check=True, cwd=ROOT)
        seconds = time.perf_counter() - started
        rows = [json.loads(line) for line in (dest / "batch.jsonl").read_text().splitlines()]
        assert all(r["status"] == "ok" for r in rows), rows
        workers = RUNS[mode][1]
        busy = sum(r["seconds"] for r in rows) / workers  # the workers' time on items
        row = {
            "mode": mode,
            "workers": workers,
            "items": len(rows),
            "seconds": round(seconds, 2),
            "items_per_minute": round(len(rows) / seconds * 60, 2),
            "item_s_mean": round(statistics.mean(r["seconds"] for r in rows), 3),
            "fixed_s": round(seconds - busy, 2),  # process start, imports, Ray, backbone loads
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def moto_server():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{port}",
    )
    return server


def ask_from_s3(work: Path, args) -> dict:
    import s3fs

    from mmkv_cli.backbones.loading import load_backbone

    write_dataset(work / "long", clips=1, frames=args.ask_frames, seed=5, kind="normal")
    video = work / "long" / "clips" / "clip_0000.mp4"
    backbone = load_backbone(LoadOptions(MODEL, "cpu", "bfloat16", layers=1))
    local = work / "long.kvpack"
    started = time.perf_counter()
    options = EncodeOptions("mukv", fps=2.0, max_frames=args.ask_frames)
    info = api.encode(str(video), local, options, backbone=backbone)
    encode_s = time.perf_counter() - started
    server = moto_server()
    try:
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        url = "s3://bench/long.kvpack"
        started = time.perf_counter()
        fs.put_file(str(local), url)
        upload_s = time.perf_counter() - started
        # what one small ranged GET of this object costs the S3 server used here (moto's grows
        # with the object's size; a real store's does not)
        started = time.perf_counter()
        for i in range(5):
            fs.cat_file(url, start=i * 4096, end=i * 4096 + 1024)
        get_s = (time.perf_counter() - started) / 5
        ask = AskOptions(generation=GenerationOptions(max_new_tokens=1))
        rows = []
        for question in QUESTIONS:
            here = api.PackSession(local, backbone=backbone).ask(question, ask)
            session = api.PackSession(url, backbone=backbone)
            opened = session.reader.source.fetched
            there = session.ask(question, ask)
            again = session.ask(question, ask)  # the blocks are in the mirror now
            rows.append(
                {
                    "question": question,
                    "blocks": len(there.blocks_used),
                    "fetched_on_open": opened,
                    "bytes_fetched": there.bytes_fetched,
                    "fetched_share": round(there.bytes_fetched / info["bytes"], 4),
                    "requests": session.reader.source.requests,
                    "ttft_local_s": round(here.ttft_s, 4),
                    "ttft_s3_s": round(there.ttft_s, 4),
                    "ttft_s3_again_s": round(again.ttft_s, 4),
                    "ttft_ratio": round(there.ttft_s / here.ttft_s, 2),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return {
        "frames": args.ask_frames,
        "tokens": info["visual_tokens_total"],
        "pack_bytes": info["bytes"],
        "blocks": info["blocks"],
        "encode_s": round(encode_s, 1),
        "upload_s": round(upload_s, 2),
        "server_ranged_get_s": round(get_s, 4),
        "questions": rows,
        "fetched_share_mean": round(statistics.mean(r["fetched_share"] for r in rows), 4),
        "fetched_share_max": max(r["fetched_share"] for r in rows),
        "ttft_ratio_median": statistics.median(r["ttft_ratio"] for r in rows),
        "ttft_again_ratio_median": statistics.median(
            round(r["ttft_s3_again_s"] / r["ttft_local_s"], 2) for r in rows
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ask-frames", type=int, default=1024)
    ap.add_argument("--skip-ask", action="store_true")
    ap.add_argument("--skip-batch", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch.json"))
    ap.add_argument("--one", choices=list(RUNS), help=argparse.SUPPRESS)  # a child: one batch
    ap.add_argument("--clips", help=argparse.SUPPRESS)
    ap.add_argument("--dest", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one_batch(args.one, Path(args.clips), Path(args.dest), args)
        return
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="mmkv-batch-bench-") as tmp:
        if not args.skip_batch:
            runs = batch_runs(Path(tmp), args)
            inproc, ray1, ray2 = runs
            result["batch"] = {
                "model": MODEL,
                "layers": args.layers,
                "frames": args.frames,
                "cores": os.cpu_count(),
                "runs": runs,
                # the whole command, start-up included, and per item once running
                "ray_overhead_1_worker": round(ray1["seconds"] / inproc["seconds"] - 1, 3),
                "ray_overhead_per_item": round(ray1["item_s_mean"] / inproc["item_s_mean"] - 1, 3),
                "speedup_2_workers_vs_1": round(
                    ray2["items_per_minute"] / ray1["items_per_minute"], 2
                ),
            }
        if not args.skip_ask:
            result["ask_s3"] = {"model": MODEL, "layers": 1, **ask_from_s3(Path(tmp), args)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {k: {x: y for x, y in v.items() if not isinstance(y, list)} for k, v in result.items()},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
