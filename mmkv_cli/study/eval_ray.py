"""`mmkv eval --ray`: a video, with all its questions for every run asked, is one work item, sent to
Ray actors that each hold a backbone (the pool `batch` uses). Each video's predictions come back as
it finishes and are appended to their runs' folders at once, so a killed eval resumes video by
video under the same settings digest; a video whose worker died is run again once on a fresh
worker, then reported failed, and the rest of the eval goes on. The answers are the in-process
run's: the same code answers a video here and there (evaluate.answer_video)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.cluster.pool import Cluster
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.study.eval_run import (
    PlannedRun,
    answer_video,
    run_config,
    run_result,
)
from mmkv_cli.study.eval_sets.items import Item
from mmkv_cli.study.runs import open_run


@dataclass(frozen=True)
class VideoWork:
    """One video and, for each run that still lacks answers about it, those questions."""

    video: str
    runs: tuple[tuple[int, PlannedRun, tuple[Item, ...]], ...]  # (run index, run, questions)


class EvalWorker:
    """A Ray actor: one backbone, loaded once, answering video after video."""

    def __init__(self, load: LoadOptions):
        from mmkv_cli.backbones.loading import load_backbone

        self.backbone = load_backbone(load)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def fingerprint(self) -> dict:
        return self.backbone.fingerprint()

    def run(self, work: VideoWork) -> dict:
        """{"rows": {run index: [prediction rows]}, "worker", "seconds"}. The pack of each run is
        made in a temporary folder of the worker's and goes with it."""
        began = time.perf_counter()
        rows: dict[int, list[dict]] = {}
        with tempfile.TemporaryDirectory(prefix="mmkv-eval-") as tmp:
            for index, run, todo in work.runs:
                pack = Path(tmp) / "clip.kvpack"
                rows[index] = list(answer_video(work.video, list(todo), pack, self.backbone, run))
        return {"rows": rows, "worker": self.name, "seconds": time.perf_counter() - began}


def evaluate_on_ray(
    items: list[Item],
    planned: list[PlannedRun],
    load: LoadOptions,
    cluster: Cluster,
    fresh: bool,
    progress: Callable[[str, int], Callable[[int], None]] | None,
) -> tuple[list[dict], dict]:
    """Every planned run over `items`, the videos spread over the cluster's actors. Returns the
    runs' results, and the eval's own figures: videos done and failed, and per worker what it
    did."""
    from mmkv_cli.cluster.pool import ActorPool, Done

    clips: dict[str, list[Item]] = {}
    for item in items:
        clips.setdefault(item.video, []).append(item)
    workers = max(1, min(cluster.workers, len(clips)))
    shape = (cluster.address, workers, cluster.cpus_per_worker, cluster.gpus_per_worker)
    with ActorPool(EvalWorker, (load,), *shape) as pool:
        fingerprint = pool.get(pool.first().fingerprint.remote(), "load the model")
        done = [open_run(run.folder, run_config(items, fingerprint, run), fresh) for run in planned]
        work = _work(clips, planned, done)
        tick = progress("videos", len(work)) if progress else None
        failures: list[dict] = []
        by_worker: dict[str, dict] = {}
        sinks = [(run.folder / "predictions.jsonl").open("a") for run in planned]
        try:

            def finished(outcome: Done) -> None:
                if outcome.error is not None:
                    failures.append({"video": outcome.item.video, "error": outcome.error})
                else:
                    _append(outcome.result, sinks, done, by_worker)
                if tick:
                    tick(_count(by_worker) + len(failures))

            began = time.perf_counter()
            pool.run(work, lambda actor, video: actor.run.remote(video), finished, retries=1)
            running = time.perf_counter() - began
        finally:
            for sink in sinks:
                sink.close()
    runs = [run_result(items, answers, run) for run, answers in zip(planned, done)]
    extra = {"videos": len(work), "failed": failures, "workers": by_worker}
    return runs, {
        **extra,
        "pool_seconds": round(running, 2),
    }  # from the first item sent to the last


def _work(clips: dict, planned: list[PlannedRun], done: list[dict]) -> list[VideoWork]:
    """A work item per video with anything left to answer in any run."""
    work = []
    for video, asked in clips.items():
        runs = []
        for index, run in enumerate(planned):
            todo = tuple(i for i in asked if i.key not in done[index])
            if todo:
                runs.append((index, run, todo))
        if runs:
            work.append(VideoWork(video, tuple(runs)))
    return work


def _append(result: dict, sinks: list, done: list[dict], by_worker: dict) -> None:
    """One video's rows into its runs' predictions.jsonl, synced: a kill loses no finished video."""
    for index, rows in result["rows"].items():
        sink = sinks[index]
        for row in rows:
            sink.write(json.dumps(row) + "\n")
            done[index][row["key"]] = row
        sink.flush()
        os.fsync(sink.fileno())
    mine = by_worker.setdefault(result["worker"], {"videos": 0, "seconds": 0.0})
    mine["videos"] += 1
    mine["seconds"] = round(mine["seconds"] + result["seconds"], 2)


def _count(by_worker: dict) -> int:
    return sum(w["videos"] for w in by_worker.values())
