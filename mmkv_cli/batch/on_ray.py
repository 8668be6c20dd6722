"""Batch items on Ray: a pool of actors, one backbone each, fed one item at a time (the next goes
to whichever actor is free). A worker that dies fails only the item it held: it is replaced and the
batch goes on. Ray is imported here only (the mmkv[ray] extra)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from mmkv_cli.batch.manifest import BatchItem
from mmkv_cli.batch.run import BatchSettings, BatchWorker
from mmkv_cli.errors import MmkvError, UsageError


def _ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray: pip install 'mmkv[ray]'") from None
    return ray


def connect(ray, address: str, cpus: float) -> None:
    """Start a local instance sized for the workers ("local": `cpus` CPUs), or join a cluster
    ("auto": the one this node belongs to; or an address such as ray://head:10001)."""
    local = {"num_cpus": max(1, int(cpus)), "include_dashboard": False, "log_to_driver": False}
    try:
        ray.init(
            address=None if address == "local" else address,
            logging_level="ERROR",
            **(local if address == "local" else {}),
        )
    except (ConnectionError, RuntimeError, ValueError) as err:
        line = (str(err).strip().splitlines() or ["no answer"])[0][:200]
        raise MmkvError(f"cannot reach the Ray cluster at {address}: {line}") from None


def _death(err: BaseException) -> str:
    """One line for a worker's death: the error that killed it where Ray says, else its kind."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    said = [ln for ln in lines if "Error:" in ln and not ln.startswith(("Traceback", "File "))]
    return f"worker died: {(said or lines or [type(err).__name__])[-1][:300]}"


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
    ray = _ray()
    connect(ray, address, workers * cpus)
    remote_worker = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0)(BatchWorker)
    actors = [remote_worker.remote(settings) for _ in range(min(workers, len(items)))]
    queue = deque(items)
    pending = {}  # result ref -> (actor, item)
    deaths_in_a_row = 0  # workers that died without finishing an item since the last that did

    def submit(actor) -> None:
        item = queue.popleft()
        pending[actor.run.remote(item, known.get(item.media))] = (actor, item)

    try:
        for actor in actors:
            submit(actor)
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            actor, item = pending.pop(ref)
            try:
                row = ray.get(ref)
                deaths_in_a_row = 0
            except ray.exceptions.RayActorError as err:
                row = {"media": item.media, "id": item.id, "status": "failed", "error": _death(err)}
                deaths_in_a_row += 1
                if deaths_in_a_row > workers + 1:  # a worker that cannot start: stop, say why
                    finished(row)
                    raise MmkvError(f"Ray workers keep dying ({row['error']})") from None
                actors.remove(actor)
                actor = remote_worker.remote(settings)
                actors.append(actor)
            except ray.exceptions.RayError as err:
                row = {"media": item.media, "id": item.id, "status": "failed", "error": _death(err)}
            finished(row)
            if queue:
                submit(actor)
    finally:
        for actor in actors:  # on a cluster, nothing of this batch keeps running after it ends
            ray.kill(actor)
        ray.shutdown()
