"""Method registry: name -> (memory policy, context policy), parameters from presets/methods/<name>.yaml."""

from __future__ import annotations

from mmkv_cli.errors import UsageError
from mmkv_cli.methods import full, mukv, recency, rekv
from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy, Selection, StreamState
from mmkv_cli.presets import MethodPreset, check_budget, load_method_preset

__all__ = ["ContextPolicy", "MemoryPolicy", "Selection", "StreamState", "METHODS", "build_method", "context_policy"]

METHODS = {module.MEMORY.name: module for module in (full, recency, rekv, mukv)}


def _module(name: str):
    if name not in METHODS:
        raise UsageError(f"unknown method '{name}' (known: {', '.join(sorted(METHODS))})")
    return METHODS[name]


def build_method(name: str, budget: float | None = None) -> tuple[MethodPreset, MemoryPolicy]:
    """The memory policy for `name` at `budget` (the preset's default when None)."""
    module = _module(name)
    preset = load_method_preset(name)
    chosen = preset.budget if budget is None else check_budget(float(budget))
    if module.MEMORY.keeps_all:
        chosen = 1.0
    return preset, module.MEMORY(chosen, preset.params)


def context_policy(name: str, params: dict) -> ContextPolicy:
    return _module(name).CONTEXT(params)
