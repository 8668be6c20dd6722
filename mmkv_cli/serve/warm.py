"""What a server keeps warm, for every channel it answers on (HTTP and the local socket): backbones
by (model, device, dtype, depth) in a small LRU, packs kept hot under a byte cap (serve/hot.py), and
the one thread every model call runs on (a device does one forward at a time anyway)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmkv_cli.api import PackSession, load_for
from mmkv_cli.backbones.held import HeldBackbones
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.serve.hot import HotPacks, default_cap, hot_place


class Warm:
    def __init__(
        self,
        load: LoadOptions,
        models: int = 2,
        cache_bytes: int | None = None,
        on_device: bool = False,
    ) -> None:
        """on_device: hold hot packs' K/V on the device (CUDA) rather than in pinned host memory;
        the byte cap counts them the same."""
        self.load = load
        self.backbones = HeldBackbones(models)
        cap = default_cap() if cache_bytes is None else cache_bytes
        self.hot = HotPacks(cap, hot_place(load.device, on_device))
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="mmkv-model")
        # sessions by (path, load), reused while their hot pack and backbone are still held
        self.sessions: dict[tuple[str, LoadOptions], PackSession] = {}
        self.last_used = time.monotonic()

    def on_model_thread(self, job):
        """`job` run on the model thread, waited for."""
        try:
            return self.worker.submit(job).result()
        finally:
            self.last_used = time.monotonic()

    def backbone(self, load: LoadOptions):
        """The backbone `load` names (model thread only), loaded once and kept in the LRU."""
        return self.backbones.get(load)

    def session(
        self, path: str | Path, load: LoadOptions | None = None, version: tuple | None = None
    ) -> PackSession:
        """A session over the hot pack at `path` (model thread only): the file as it is now, its
        backbone by `load` (default: the server's) and the pack's own model."""
        pack = self.hot.take(path, version)
        load = load or self.load
        held = self.sessions.get((str(path), load))
        loaded = self.backbones.values()
        if held is not None and held.reader is pack and any(b is held.backbone for b in loaded):
            return held  # the same file and weights: its method and model checks stand
        backbone = self.backbone(load_for(pack.reader, load))
        pack.device = backbone.device  # where a pack held on the device goes
        self.sessions[(str(path), load)] = session = PackSession(pack, backbone=backbone)
        return session

    def ask(self, session: PackSession, question: str, options, on_token=None):
        """One question on a warm session, the hot packs trimmed to the cap after it."""
        try:
            return session.ask(question, options, on_token)
        finally:
            self.hot.asked(session.reader)
            self.hot.trim(keep=session.reader)
            kept = {id(entry.pack) for entry in self.hot.packs.values()}
            self.sessions = {k: s for k, s in self.sessions.items() if id(s.reader) in kept}

    def preload(self, load: LoadOptions | None = None) -> None:
        """Load the server's model (default: the default model) before any request (model
        thread), held under the key a pack's load gives it: its depth named."""
        self.backbone(load or self.load)

    def models(self) -> list[dict]:
        """The loaded backbones, most recent first, with their weights' bytes."""
        loaded = self.backbones.items()
        return [
            {
                "model": load.model,
                "device": str(backbone.device),
                "dtype": str(backbone.dtype).removeprefix("torch."),
                "layers": load.layers,
                "bytes": _weights_bytes(backbone),
            }
            for load, backbone in loaded
        ]

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        self.sessions.clear()
        self.hot.clear()


def _weights_bytes(backbone) -> int:
    model = backbone.model
    return sum(p.numel() * p.element_size() for p in model.parameters())
