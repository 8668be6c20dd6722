"""The token-reducer registry: every reducer in code, by name (`encode --reduce NAME`)."""

from __future__ import annotations

from mmkv_cli.reduce import ctr, dtd, stc, visionzip
from mmkv_cli.reduce.base import Reduced, Reducer, StepTokens

__all__ = ["REDUCERS", "Reduced", "Reducer", "StepTokens"]

REDUCERS: dict[str, Reducer] = {
    module.REDUCER.name: module.REDUCER for module in (dtd, ctr, visionzip, stc)
}
