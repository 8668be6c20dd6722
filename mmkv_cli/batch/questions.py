"""Many packs, one set of questions (`mmkv ask --questions FILE`, each line naming its pack, here or
`--ray` on a cluster): the questions are grouped by pack, so each pack is opened once per worker,
and every answer, or its one error line, is handed out in the order of the file."""

from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from mmkv_cli.cluster.pool import Cluster
from mmkv_cli.core.errors import MmkvError
from mmkv_cli.core.options import AskOptions, LoadOptions

BACKBONES_HELD = 2  # backbones a worker keeps loaded (packs of several models: least recent goes)


@dataclass(frozen=True)
class Asked:
    """One line of the questions file: where it stands in the file, and what it asks."""

    index: int
    pack: str
    question: str
    at: float | None = None
    id: str | int | None = None


@dataclass(frozen=True)
class PackWork:
    """One pack and every question the file asks of it: a work item."""

    pack: str
    asked: tuple[Asked, ...]


def by_pack(asked: list[Asked]) -> list[PackWork]:
    """The questions grouped by pack, packs in the order the file first names them."""
    groups: dict[str, list[Asked]] = {}
    for a in asked:
        groups.setdefault(a.pack, []).append(a)
    return [PackWork(pack, tuple(group)) for pack, group in groups.items()]


def error_record(a: Asked, message: str) -> dict:
    record = {"id": a.id} if a.id is not None else {}
    return {**record, "pack": a.pack, "question": a.question, "at": a.at, "error": message}


class AskWorker:
    """Answers one pack's questions at a time, opening the pack once; holds the backbones its
    packs name (at most BACKBONES_HELD). Runs in this process or as a Ray actor."""

    def __init__(self, load: LoadOptions, options: AskOptions, explain: bool):
        self.load, self.options, self.explain = load, options, explain
        self.backbones: OrderedDict[LoadOptions, object] = OrderedDict()
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def _backbone(self, load: LoadOptions):
        from mmkv_cli.backbones.loading import load_backbone

        if load in self.backbones:
            self.backbones.move_to_end(load)
        else:
            self.backbones[load] = load_backbone(load)
            while len(self.backbones) > BACKBONES_HELD:
                self.backbones.popitem(last=False)
        return self.backbones[load]

    def run(self, work: PackWork) -> dict:
        """{"records": [(file index, record)], "worker", "seconds"}: an answer record or an error
        record for every question, whatever fails (a missing pack fails its questions only)."""
        from dataclasses import replace

        from mmkv_cli.api import PackSession, answer_record, load_for
        from mmkv_cli.pack import PackReader

        began = time.perf_counter()
        records = []
        try:
            reader = PackReader(work.pack)
            session = PackSession(reader, backbone=self._backbone(load_for(reader, self.load)))
        except MmkvError as err:
            records = [(a.index, error_record(a, str(err))) for a in work.asked]
            return {"records": records, "worker": self.name, "seconds": 0.0}
        try:
            for a in work.asked:
                options = replace(self.options, at=a.at if a.at is not None else self.options.at)
                try:
                    answer = session.ask(a.question, options)
                except MmkvError as err:
                    records.append((a.index, error_record(a, str(err))))
                    continue
                record = answer_record(answer, a.question, options.at, a.id, self.explain)
                records.append((a.index, {"pack": work.pack, **record}))
        finally:
            reader.source.close()
        return {"records": records, "worker": self.name, "seconds": time.perf_counter() - began}


class InOrder:
    """Records handed out in file order as soon as every earlier one is there."""

    def __init__(self, emit: Callable[[dict], None]):
        self.emit, self.waiting, self.next = emit, {}, 0

    def put(self, index: int, record: dict) -> None:
        self.waiting[index] = record
        while self.next in self.waiting:
            self.emit(self.waiting.pop(self.next))
            self.next += 1


def answer_all(
    asked: list[Asked],
    load: LoadOptions,
    options: AskOptions,
    explain: bool,
    emit: Callable[[dict], None],
    cluster: Cluster | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Every question answered, here or on the Ray `cluster`, emit(record) called in file order.
    Returns {"failed": questions that got an error, "workers": per worker the packs it answered
    and its seconds}."""
    ordered = InOrder(emit)
    work = by_pack(asked)
    by_worker: dict[str, dict] = {}
    failed = 0

    def finished(result: dict) -> None:
        nonlocal failed
        for index, record in result["records"]:
            failed += "error" in record
            ordered.put(index, record)
        mine = by_worker.setdefault(result["worker"], {"packs": 0, "seconds": 0.0})
        mine["packs"] += 1
        mine["seconds"] = round(mine["seconds"] + result["seconds"], 2)
        if progress:
            progress(ordered.next)

    if cluster is None:
        worker = AskWorker(load, options, explain)
        for item in work:
            finished(worker.run(item))
    else:
        from mmkv_cli.cluster.pool import ActorPool, Done

        def done(outcome: Done) -> None:
            if outcome.error is None:
                finished(outcome.result)
            else:  # its worker died twice: the pack's questions each get the line why
                records = [(a.index, error_record(a, outcome.error)) for a in outcome.item.asked]
                finished({"records": records, "worker": "lost", "seconds": 0.0})

        workers = max(1, min(cluster.workers, len(work)))
        shape = (cluster.address, workers, cluster.cpus_per_worker, cluster.gpus_per_worker)
        with ActorPool(AskWorker, (load, options, explain), *shape) as pool:
            pool.run(work, lambda actor, item: actor.run.remote(item), done, retries=1)
    return {"failed": failed, "workers": by_worker}
