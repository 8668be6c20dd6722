"""Backbones held loaded for many calls: a small LRU keyed by how each was loaded (model, device,
dtype, depth). A server holds one for its requests; `import mmkv` holds one for a process, so
`mmkv.ask` and `mmkv.encode` in a loop load the model once (`mmkv.unload()` lets go)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace
from typing import TYPE_CHECKING

from mmkv_cli.core.options import LoadOptions

if TYPE_CHECKING:
    from mmkv_cli.backbones.base import Backbone


class HeldBackbones:
    """At most `capacity` backbones, the least recently used let go first. Each is held under its
    depth named, so a load that leaves the depth unsaid (an encode's) and one that says it (a
    pack's) meet on the same weights."""

    def __init__(self, capacity: int = 2):
        self.capacity = max(1, capacity)
        self._held: OrderedDict[LoadOptions, Backbone] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, load: LoadOptions) -> Backbone:
        """The backbone `load` names, loaded on its first call (one caller loads at a time)."""
        from mmkv_cli.backbones.loading import load_backbone, placed

        load = placed(load)  # a default and what it means: the same weights
        with self._lock:
            key = self._held_as(load)
            if key is not None:
                self._held.move_to_end(key)
                return self._held[key]
        backbone = load_backbone(load)
        with self._lock:
            self._held[replace(load, layers=backbone.kv_shape()["layers"])] = backbone
            while len(self._held) > self.capacity:
                self._held.popitem(last=False)
        return backbone

    def _held_as(self, load: LoadOptions) -> LoadOptions | None:
        if load.layers is not None:
            return load if load in self._held else None
        return next((k for k in self._held if replace(k, layers=None) == load), None)

    def items(self) -> list[tuple[LoadOptions, Backbone]]:
        """(load, backbone), the most recently used first."""
        with self._lock:
            return list(reversed(self._held.items()))

    def values(self) -> list[Backbone]:
        with self._lock:
            return list(self._held.values())

    def clear(self) -> None:
        with self._lock:
            self._held.clear()

    def __iter__(self):
        return iter(list(self._held))

    def __len__(self) -> int:
        return len(self._held)
