"""The method registry: every method in code, by name. Presets (mmkv_cli.presets) name variants."""

from __future__ import annotations

from mmkv_cli.methods import (
    aircache,
    causalmem,
    dscache,
    fluxmem,
    full,
    h2o,
    hermes,
    infinipot,
    meda,
    mukv,
    pyramidkv,
    recency,
    rekv,
    savemem,
    simplestream,
    snapkv,
    streamingtom,
    streammem,
)
from mmkv_cli.methods.base import Budget, EncodeContext, Method, Paper, Selection

__all__ = ["METHODS", "Budget", "EncodeContext", "Method", "Paper", "Selection", "pruning_methods"]

METHODS: dict[str, Method] = {
    module.METHOD.name: module.METHOD
    for module in (
        full,
        recency,
        rekv,
        mukv,
        hermes,
        infinipot,
        snapkv,
        h2o,
        pyramidkv,
        aircache,
        meda,
        streamingtom,
        streammem,
        simplestream,
        causalmem,
        fluxmem,
        dscache,
        savemem,
    )
}


def pruning_methods() -> list[str]:
    """The methods that prune a context by the question at ask (`ask --prune`), by name."""
    return sorted(name for name, method in METHODS.items() if method.prune_at_ask is not None)
