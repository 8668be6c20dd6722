"""Method registry: name -> (memory policy, context policy), parameters from presets/methods/<name>.yaml."""

from __future__ import annotations

from dataclasses import replace

from mmkv_cli.errors import UsageError
from mmkv_cli.methods import (
    aircache,
    full,
    h2o,
    hermes,
    meda,
    mukv,
    pyramidkv,
    recency,
    rekv,
    snapkv,
)
from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy, Selection, StreamState
from mmkv_cli.presets import MethodPreset, check_budget, load_method_preset

__all__ = [
    "ContextPolicy",
    "MemoryPolicy",
    "Selection",
    "StreamState",
    "METHODS",
    "build_method",
    "context_policy",
]

METHODS = {
    module.MEMORY.name: module
    for module in (full, recency, rekv, mukv, hermes, snapkv, h2o, pyramidkv, aircache, meda)
}


def _module(name: str):
    """The module running method preset `name` (a preset may extend another: hermes-6k runs hermes)."""
    implements = load_method_preset(name).implements
    if implements not in METHODS:
        raise UsageError(f"method preset '{name}' names no implementation ('{implements}')")
    return METHODS[implements]


def build_method(
    name: str, budget: float | None = None, budget_tokens: int | None = None
) -> tuple[MethodPreset, MemoryPolicy]:
    """The memory policy for `name` at `budget` (the preset's default when None).

    A method with a fixed token budget (budget_tokens in its preset) takes `budget_tokens` when given; an
    explicit fractional `budget` replaces its preset's token count.
    """
    module = _module(name)
    preset = load_method_preset(name)
    chosen = preset.budget if budget is None else check_budget(float(budget))
    params = dict(preset.params)
    if budget_tokens is not None:
        if budget_tokens < 1:
            raise UsageError(f"--budget-tokens must be at least 1, got {budget_tokens}")
        if "budget_tokens" not in params:
            raise UsageError(
                f"method '{name}' has no fixed token budget: use --budget (a fraction)"
            )
        params["budget_tokens"] = int(budget_tokens)
    elif budget is not None and "budget_tokens" in params:
        params["budget_tokens"] = None
    if module.MEMORY.keeps_all:
        chosen = 1.0
    return replace(preset, params=params), module.MEMORY(chosen, params)


def context_policy(name: str, params: dict) -> ContextPolicy:
    """name: an implementation (as packs record it) or a method preset."""
    return (METHODS.get(name) or _module(name)).CONTEXT(params)
