"""Live streams and chats on one server: one backbone, one model queue.

    python bench/serve_streams.py [--model demo] [--streams 4] [--seconds 60] [--fps 2]

A server over one pack; first the chat alone (a question to the pack every 0.25 s, its latency),
then --streams streams following recordings already whole (read as fast as the encode takes them:
each stream's real-time factor is its stream seconds over the wall seconds it took, less its stall
wait) while the same chat goes on. Reported: each stream's real-time factor, the chat's p50 / p99
latency alone and beside the streams. Results: bench/results/serve-streams.json.
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
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STALL_S = 1.0
QUESTION = {"messages": [{"role": "user", "content": "what color is the circle ?"}]}


def recording(path: Path, seconds: float, seed: int) -> None:
    """An MPEG-TS of a square wandering over a coloured field, 4 frames a second, 128 x 128."""
    import av

    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", format="mpegts") as out:
        stream = out.add_stream("h264", rate=4)
        stream.width = stream.height = 128
        stream.pix_fmt = "yuv420p"
        for i in range(int(seconds * 4)):
            frame = np.full((128, 128, 3), rng.integers(0, 255, 3), dtype=np.uint8)
            x = (i * 7) % 96
            frame[40:72, x : x + 32] = 255 - frame[0, 0]
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_while(http: httpx.Client, model: str, going: threading.Event) -> list[float]:
    """A question every 0.25 s while `going` is set: each one's latency in seconds."""
    took = []
    while going.is_set():
        began = time.perf_counter()
        reply = http.post(
            "/v1/chat/completions", json={"model": model, **QUESTION, "max_tokens": 4}
        )
        reply.raise_for_status()
        took.append(time.perf_counter() - began)
        time.sleep(max(0.0, 0.25 - (time.perf_counter() - began)))
    return took


def chatting(http: httpx.Client, model: str, seconds: float | None, done=None) -> list[float]:
    going = threading.Event()
    going.set()
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.extend(chat_while(http, model, going)))
    thread.start()
    if seconds is not None:
        time.sleep(seconds)
    else:
        done()
    going.clear()
    thread.join()
    return out


def spread(took: list[float]) -> dict:
    ordered = sorted(took)
    return {
        "requests": len(took),
        "p50_s": round(statistics.median(ordered), 4),
        "p99_s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--budget-tokens", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mmkv-streams-bench-"))
    packs = work / "packs"
    packs.mkdir()
    run = [sys.executable, "-m", "mmkv_cli"]
    subprocess.run(
        [*run, "encode", "samples/clip.mp4", "--model", args.model, "--method", "full"]
        + ["-o", str(packs / "clip.kvpack"), "--device", "cpu"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    sources = []
    for i in range(args.streams):
        sources.append(work / f"cam{i}.ts")
        recording(sources[-1], args.seconds, i)
    port = free_port()
    server = subprocess.Popen(
        [*run, "serve", "--packs", str(packs), "--port", str(port), "--device", "cpu"]
        + ["--model", args.model, "--preload"],
        cwd=ROOT,
        env={**os.environ, "MMKV_API_KEY": "", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        alone = chatting(http, "clip", 10.0)
        began: dict[str, float] = {}
        for i, source in enumerate(sources):
            name = f"cam{i}"
            request = {"name": name, "source": str(source), "model": args.model, "fps": args.fps}
            request |= {"budget_tokens": args.budget_tokens, "stall_s": STALL_S}
            http.post("/v1/streams", json=request).raise_for_status()
            began[name] = time.perf_counter()
        ended: dict[str, dict] = {}

        def wait_for_streams() -> None:
            while len(ended) < len(began):
                for name in began:
                    state = http.get(f"/v1/streams/{name}").json()
                    if name not in ended and state["state"] != "running":
                        ended[name] = {**state, "wall_s": time.perf_counter() - began[name]}
                time.sleep(0.1)

        beside = chatting(http, "clip", None, wait_for_streams)
    finally:
        server.terminate()
        server.wait(30)
    streams = {
        name: {
            "state": s["state"],
            "frames": s["frames"],
            "stream_s": s["moment"],
            "wall_s": round(s["wall_s"], 2),
            "real_time_factor": round(s["moment"] / max(1e-9, s["wall_s"] - STALL_S), 2),
        }
        for name, s in ended.items()
    }
    result = {
        "args": vars(args),
        "streams": streams,
        "chat_alone": spread(alone),
        "chat_beside_streams": spread(beside),
    }
    for name, s in streams.items():
        print(f"{name}: {s['frames']} frames, {s['real_time_factor']}x real time ({s['state']})")
    print(
        f"chat alone: {result['chat_alone']}; beside the streams: {result['chat_beside_streams']}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve-streams.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
