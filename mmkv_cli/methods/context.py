"""The default context policy: every stored block shown by the question's moment, in time order."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mmkv_cli.methods.base import QuestionVector, Selection, TakenIn
from mmkv_cli.pack import eligible_at

if TYPE_CHECKING:
    import numpy as np
    import torch

    from mmkv_cli.pack import BlockTable


def last_shown(blocks: BlockTable, eligible: np.ndarray, at: float | None) -> str | None:
    """The last block (in time order) shown by the question's moment; None without a moment."""
    return blocks.name(int(eligible[-1])) if at is not None and len(eligible) else None


class WholeContext:
    """Every stored block, in time order, at its stored or compacted positions."""

    def __init__(self, positions: str = "keep"):
        self.position_mode = positions

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: QuestionVector,
        at: float | None = None,
        taken_in: TakenIn | None = None,
    ) -> Selection:
        eligible = eligible_at(blocks, at)
        names = [blocks.name(i) for i in eligible.tolist()]
        return Selection(names, [], last_shown(blocks, eligible, at))
