"""Many questions on one pack: a process per question, one `ask` with all of them, `mmkv serve`.

    python bench/serve.py [--model demo] [--method full] [--questions 20] [--clients 8]

For 20 questions on one pack: wall time per question of (a) 20 `mmkv ask` processes, (b) one
`mmkv ask` given all 20, (c) 20 sequential requests to a running `mmkv serve`; and the in-process
time to answer (`total_s`). Then p50/p99 request latency with 8 concurrent clients. Goals (issue
14): through serve, wall per question <= 2x the in-process answer time, and >= 20x faster than one
process per question. Results: bench/results/serve.json.
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

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BASE = [
    "what color is the circle ?",
    "which shape appeared first ?",
    "what happened last ?",
    "how many shapes appeared ?",
    "what shape is shown at the end ?",
]


def mmkv(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        input=stdin,
        text=True,
        capture_output=True,
        cwd=ROOT,
        check=True,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--method", default="full")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    questions = [BASE[i % len(BASE)] for i in range(args.questions)]
    n = len(questions)
    work = Path(tempfile.mkdtemp(prefix="mmkv-serve-bench-"))
    pack = work / "clip.kvpack"
    mmkv(
        "encode",
        "samples/clip.mp4",
        "--model",
        args.model,
        "--method",
        args.method,
        "-o",
        str(pack),
        "--device",
        "cpu",
    )
    row: dict = {"model": args.model, "method": args.method, "questions": n}

    started = time.perf_counter()
    for q in questions:  # (a) one process per question
        mmkv("ask", str(pack), q, "--device", "cpu")
    row["process_per_question_s"] = (time.perf_counter() - started) / n

    started = time.perf_counter()  # (b) one process, every question
    out = mmkv(
        "ask",
        str(pack),
        "--questions",
        "-",
        "--json",
        "--device",
        "cpu",
        stdin="\n".join(questions) + "\n",
    )
    row["one_ask_s_per_question"] = (time.perf_counter() - started) / n
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    row["in_process_answer_s"] = statistics.mean(a["total_s"] for a in answers)

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmkv_cli",
            "serve",
            "--packs",
            str(work),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        env={**os.environ, "MMKV_API_KEY": ""},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = httpx.Client(base_url=base, timeout=120)

        def request(q: str) -> float:
            began = time.perf_counter()
            reply = client.post(
                "/v1/chat/completions",
                json={"model": "clip", "messages": [{"role": "user", "content": q}]},
            )
            reply.raise_for_status()
            return time.perf_counter() - began

        request(questions[0])  # the first request loads the model: not a question's cost
        started = time.perf_counter()
        for q in questions:  # (c) sequential requests to a warm server
            request(q)
        row["serve_s_per_question"] = (time.perf_counter() - started) / n

        latencies: list[float] = []
        lock = threading.Lock()

        def client_loop(share: list[str]) -> None:
            mine = httpx.Client(base_url=base, timeout=120)
            for q in share:
                began = time.perf_counter()
                mine.post(
                    "/v1/chat/completions",
                    json={"model": "clip", "messages": [{"role": "user", "content": q}]},
                ).raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - began)

        shares = [questions[i :: args.clients] for i in range(args.clients)]
        threads = [threading.Thread(target=client_loop, args=(s,)) for s in shares]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        latencies.sort()
        row["concurrent_clients"] = args.clients
        row["p50_s"] = latencies[len(latencies) // 2]
        row["p99_s"] = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    finally:
        server.terminate()
        server.wait(timeout=20)
    row["serve_over_in_process"] = row["serve_s_per_question"] / row["in_process_answer_s"]
    row["process_over_serve"] = row["process_per_question_s"] / row["serve_s_per_question"]
    row["goals_met"] = row["serve_over_in_process"] <= 2 and row["process_over_serve"] >= 20
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "serve.json").write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
