"""A token reducer as a user names it (`encode --reduce NAME`, or `reduce:` and `reduce_params:`
in a method preset), its parameters checked against their types before any work, and the refusals
that need no model: a temporal reducer on images or pages, one that reads the tower's attention on
a family whose adapter does not expose it."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.spec import as_plain, override
from mmkv_cli.reduce import REDUCERS, Reducer

NONE = "none"  # `--reduce none`: no reducer, whatever the preset or method names


@dataclass(frozen=True)
class ReducerChoice:
    reducer: Reducer
    params: Any  # an instance of reducer.params

    @property
    def name(self) -> str:
        return self.reducer.name

    def record(self) -> dict:
        """As a pack's header and a checkpoint's identity hold it."""
        return {"name": self.reducer.name, "params": as_plain(self.params)}


def resolve_reducer(
    name: str | None,
    params: Mapping | None = None,
    where: str = "--reduce",
    base: ReducerChoice | None = None,
) -> ReducerChoice | None:
    """The reducer called `name` (None or 'none': no reducer) with `params` over its defaults, or
    over `base`'s parameters when `base` is that reducer (a preset extending one that set them)."""
    if name is None or name == NONE:
        if params:
            raise UsageError(f"{where}: reduce_params given without a reducer")
        return None
    if not isinstance(name, str) or name not in REDUCERS:
        near = difflib.get_close_matches(str(name), list(REDUCERS), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        known = ", ".join([*REDUCERS, NONE])
        raise UsageError(f"{where}: unknown reducer '{name}': {hint}(known: {known})")
    reducer = REDUCERS[name]
    if params is not None and not isinstance(params, Mapping):
        raise UsageError(f"{where}: reduce_params must be a mapping")
    start = base.params if base is not None and base.reducer is reducer else reducer.params()
    return ReducerChoice(reducer, override(start, params or {}, f"{where}: reduce_params"))


def check_reducer(
    choice: ReducerChoice | None,
    media_kind: str,
    family: str | None,
    tower_families: list[str],
    reuse_families: list[str] = (),  # type: ignore[assignment]
) -> None:
    """Refuse, before any work, a reducer the media or the backbone cannot serve. family: the
    backbone's (None: not known yet, checked again once it is); tower_families: the families whose
    adapters expose the vision tower's attention, reuse_families: those that reuse its layers
    across frames (the backbone registry's)."""
    if choice is None:
        return
    if choice.reducer.temporal and media_kind != "video":
        raise UsageError(
            f"reducer '{choice.name}' compares each frame with the one before: it takes video, "
            f"not {media_kind}"
        )
    if choice.reducer.tower_attention and family is not None and family not in tower_families:
        raise UsageError(
            f"reducer '{choice.name}' reads the vision tower's attention, which the {family} "
            f"adapter does not expose (these do: {', '.join(tower_families) or 'none'})"
        )
    reuse = choice.reducer.tower_reuse
    if (
        reuse is not None
        and reuse(choice.params)
        and family is not None
        and (family not in reuse_families)
    ):
        raise UsageError(
            f"reducer '{choice.name}' reuses the vision tower's layers across frames, which the "
            f"{family} adapter does not do (these do: {', '.join(reuse_families) or 'none'}); "
            f"reduce_params reuse_every: 1 runs the tower whole"
        )
