"""`mmkv eval --ray` (issue 41): the same predictions as in-process, Ray's overhead, and what a lost
worker or an interrupted eval costs.

    python bench/eval_ray.py [--clips 8] [--frames 96] [--seed 4141]

On a fresh synthetic set (demo backbone; methods full and hermes at 16 tokens, stream and replay
protocols both), each mode a fresh `mmkv eval` process timed start to exit:
1. in-process; Ray with 1 worker given every core; Ray with 2 workers of one core each. The
   predictions (raw answers, per run and question) must be identical. Reported: seconds for the
   whole command, and per video once running (the workers' own seconds), Ray's overhead over
   in-process for both.
2. Kill a worker mid-run (SIGKILL to one `EvalWorker` actor once a video is done): the eval ends
   with every video answered once (its video is retried on a fresh worker), nothing twice.
3. Ctrl-C mid-run, then the same command again: the rerun sends only the videos not finished, and
   no question is answered twice in any run folder.
Writes bench/results/eval_ray.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "in-process": [],
    "ray-1": ["--ray", "local"],
    "ray-2": ["--ray", "local", "--workers", "2"],
}
RAY_CPUS = {"ray-1": ["--cpus-per-worker", str(os.cpu_count() or 1)], "ray-2": []}


def command(qa: Path, out: Path, mode: str) -> list[str]:
    args = [sys.executable, "-m", "mmkv_cli", "eval", str(qa), "-m", "demo", "-o", str(out)]
    args += ["--methods", "full,hermes", "--budget-tokens", "16", "--budgets", "0.5"]
    return args + ["--max-new-tokens", "2", "--json", *MODES[mode], *RAY_CPUS.get(mode, [])]


def answers(out: Path) -> dict:
    """run -> key -> raw answer, and the count of rows (a question answered twice counts twice)."""
    found, rows = {}, 0
    for path in sorted(out.glob("demo/*/predictions.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        rows += len(lines)
        found[path.parent.name] = {r["key"]: r["raw"] for r in lines}
    return {"answers": found, "rows": rows}


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def timed(qa: Path, out: Path, mode: str) -> dict:
    began = time.perf_counter()
    done = subprocess.run(command(qa, out, mode), capture_output=True, text=True, env=env())
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed: {done.stderr[-1500:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    per_video = sum(w["seconds"] for w in report.get("workers", {}).values())
    return {"seconds": round(seconds, 2), "worker_seconds": round(per_video, 2), "report": report}


def worker_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "EvalWorker"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def interrupted(qa: Path, out: Path, mode: str, how) -> subprocess.Popen:
    """Start an eval and apply `how(process)` once its first video's answers are on disk."""
    process = subprocess.Popen(
        command(qa, out, mode), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )
    while process.poll() is None and not list(out.glob("demo/*/predictions.jsonl")):
        time.sleep(0.2)
    while process.poll() is None and answers(out)["rows"] == 0:
        time.sleep(0.2)
    how(process)
    return process


def _report(out: str, err: str):
    """The eval's JSON report, or what it said instead."""
    try:
        report = json.loads(out.strip().splitlines()[-1])  # Ray may print lines of its own first
        return {k: v for k, v in report.items() if k in ("videos", "failed", "workers")}
    except (json.JSONDecodeError, IndexError):
        return {"stdout": out[-500:], "stderr": err[-1000:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--frames", type=int, default=96)  # long enough to kill a worker mid-run
    parser.add_argument("--seed", type=int, default=4141)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmkv-eval-ray-") as folder:
        tmp = Path(folder)
        subprocess.run(
            [sys.executable, "-m", "mmkv_cli", "synth", str(tmp / "set"), "--clips",
             str(args.clips), "--frames", str(args.frames), "--seed", str(args.seed)],
            check=True, capture_output=True, env=env(),
        )  # fmt: skip
        qa = tmp / "set" / "qa.jsonl"
        modes = {mode: timed(qa, tmp / mode, mode) for mode in MODES}
        reference = answers(tmp / "in-process")
        identical = {mode: answers(tmp / mode) == reference for mode in MODES}
        base = modes["in-process"]["seconds"]
        one = modes["ray-1"]

        def kill_one(process):
            pids = worker_pids()
            if pids:
                os.kill(pids[0], signal.SIGKILL)

        killed = interrupted(qa, tmp / "killed", "ray-2", kill_one)
        out, err = killed.communicate(timeout=1200)
        after_kill = answers(tmp / "killed")

        def ctrl_c(process):
            process.send_signal(signal.SIGINT)

        stopped = interrupted(qa, tmp / "stopped", "ray-2", ctrl_c)
        stopped.communicate(timeout=600)
        rows_before = answers(tmp / "stopped")["rows"]
        rerun = timed(qa, tmp / "stopped", "ray-2")
        after_rerun = answers(tmp / "stopped")
    questions = reference["rows"]
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "clips": args.clips,
        "frames": args.frames,
        "seed": args.seed,
        "cpus": os.cpu_count(),
        "questions_x_runs": questions,
        "seconds": {mode: modes[mode]["seconds"] for mode in MODES},
        "videos_per_minute": {
            mode: round(args.clips / modes[mode]["seconds"] * 60, 2) for mode in MODES
        },
        "predictions_identical_to_in_process": identical,
        "ray_overhead_whole_command": round(one["seconds"] / base - 1, 3),
        # one worker: the pool's wall time from the first video sent to the last answer back, over
        # the seconds the worker spent answering (what Ray adds to each item once running)
        "ray_overhead_per_video_once_running": round(
            one["report"]["pool_seconds"] / one["worker_seconds"] - 1, 3
        ),
        "worker_killed": {
            "exit": killed.returncode,
            "rows": after_kill["rows"],
            "every_question_once": after_kill == reference,
            "report": _report(out, err),
        },
        "ctrl_c_then_rerun": {
            "rows_before_rerun": rows_before,
            "videos_sent_on_rerun": rerun["report"]["videos"],
            "every_question_once": after_rerun == reference,
        },
    }
    print(json.dumps(result, indent=1))
    path = ROOT / "bench" / "results" / "eval_ray.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
