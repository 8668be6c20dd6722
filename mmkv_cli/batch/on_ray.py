"""Batch items on Ray: the actor pool of mmkv_cli.cluster, one backbone each, fed one item at a
time. A worker that dies fails only the item it held: it is replaced and the batch goes on."""

from __future__ import annotations

from collections.abc import Callable

from mmkv_cli.batch.manifest import BatchItem
from mmkv_cli.batch.run import BatchSettings, BatchWorker
from mmkv_cli.cluster.pool import ActorPool, Done


def run_on_ray(
    items: list[BatchItem],
    settings: BatchSettings,
    address: str,
    workers: int,
    cpus: float,
    gpus: float,
    known: dict[str, dict],
    finished: Callable[[dict], None],
) -> None:
    def call(actor, item: BatchItem):
        return actor.run.remote(item, known.get(item.media))

    def row(done: Done) -> None:
        if done.error is None:
            finished(done.result)
        else:
            item = done.item
            finished({"media": item.media, "id": item.id, "status": "failed", "error": done.error})

    pool = ActorPool(
        BatchWorker, (settings,), address, max(1, min(workers, len(items))), cpus, gpus
    )
    with pool:
        # a batch item that killed its worker is not run again: encodes are what crash workers
        pool.run(items, call, row, retries=0)
