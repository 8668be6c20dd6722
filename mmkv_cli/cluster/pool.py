"""A pool of Ray actors, each holding what it loads once (a backbone), fed one item at a time: the
next goes to whichever actor is free, and each result comes back as soon as it is done. An actor
that dies costs only the item it held: the item is retried on a fresh actor (as often as asked),
then reported failed, and the work goes on. Ray is imported here only."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mmkv_cli.core.errors import MmkvError, UsageError


def ray_module():
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


def death(err: BaseException) -> str:
    """One line for a failed item: the error Ray reports where it says one, else its kind."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    said = [ln for ln in lines if "Error:" in ln and not ln.startswith(("Traceback", "File "))]
    return (said or lines or [type(err).__name__])[-1][:300]


@dataclass(frozen=True)
class Cluster:
    """Where work runs on Ray: an address (local, auto, ray://...) and the workers' shape."""

    address: str
    workers: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0


@dataclass
class Done:
    """What became of one item: its result, or the one line why it has none."""

    item: object
    result: object = None
    error: str | None = None
    worker: int = -1  # which actor of the pool ran it (replacements get new numbers)


class ActorPool:
    """`workers` actors of `worker_class(*args)`, each reserving `cpus` CPUs and `gpus` GPUs, on
    the Ray instance at `address` (local, auto, or ray://host:port). Use as a context manager:
    nothing of the pool keeps running after it."""

    def __init__(self, worker_class, args: tuple, address: str, workers: int, cpus: float, gpus):
        if workers < 1:
            raise UsageError("--workers must be at least 1")
        if cpus <= 0 or gpus < 0:
            raise UsageError("--cpus-per-worker must be positive and --gpus-per-worker 0 or more")
        self.ray = ray_module()
        self.address, self.workers, self.cpus = address, workers, cpus
        self._class, self._args, self._gpus = worker_class, args, gpus
        self.actors: dict[int, object] = {}  # number -> handle
        self._made = 0

    def __enter__(self) -> ActorPool:
        connect(self.ray, self.address, self.workers * self.cpus)
        remote = self.ray.remote(num_cpus=self.cpus, num_gpus=self._gpus, max_restarts=0)
        self._remote = remote(self._class)
        for _ in range(self.workers):
            self._start()
        return self

    def __exit__(self, *exc) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor)
        self.ray.shutdown()

    def _start(self) -> int:
        self._made += 1
        self.actors[self._made] = self._remote.remote(*self._args)
        return self._made

    def first(self):
        """An actor of the pool, to ask something of before the work (its model's fingerprint)."""
        return next(iter(self.actors.values()))

    def get(self, ref, what: str):
        """A remote call's result; an actor that could not start is one clear error."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayError as err:
            raise MmkvError(f"a Ray worker could not {what}: {death(err)}") from None

    def run(
        self,
        items: list,
        call: Callable[[object, object], object],
        finished: Callable[[Done], None],
        retries: int = 1,
    ) -> None:
        """call(actor, item) -> the ref of its remote call; finished(Done) for every item, in the
        order they finish. An item whose actor died is run again up to `retries` times."""
        ray = self.ray
        queue = deque((item, retries) for item in items)
        pending: dict = {}  # ref -> (actor number, item, retries left)
        deaths_in_a_row = 0  # actors that died without finishing an item since the last that did

        def submit(number: int) -> None:
            item, left = queue.popleft()
            pending[call(self.actors[number], item)] = (number, item, left)

        for number in list(self.actors)[: len(queue)]:
            submit(number)
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            number, item, left = pending.pop(ref)
            try:
                done = Done(item, ray.get(ref), worker=number)
                deaths_in_a_row = 0
            except ray.exceptions.RayActorError as err:
                deaths_in_a_row += 1
                if deaths_in_a_row > self.workers + 1:  # an actor that cannot start: stop, say why
                    finished(Done(item, error=f"worker died: {death(err)}", worker=number))
                    raise MmkvError(f"Ray workers keep dying ({death(err)})") from None
                del self.actors[number]
                number = self._start()
                if left > 0:
                    queue.appendleft((item, left - 1))
                    submit(number)
                    continue
                done = Done(item, error=f"worker died: {death(err)}", worker=number)
            except ray.exceptions.RayError as err:
                done = Done(item, error=death(err), worker=number)
            finished(done)
            if queue:
                submit(number)
