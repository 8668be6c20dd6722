"""TimeChat-Online's Differential Token Drop: a token whose embedding barely changed since the same
place of the step before is not prefilled. As the authors' Qwen2.5-VL code does (feature mode, the
scripts' setting): the language model's input embeddings compared by cosine, the step before taken
whole, the stream's first step kept whole, no budget (a still scene costs little, a busy one what
it costs)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.spec import Paper, knob
from mmkv_cli.reduce.base import Reduced, Reducer, StepTokens, similarity_to_previous


@dataclass(frozen=True)
class DTDParams:
    drop_threshold: float = knob(
        0.5,
        "a token more similar than this (cosine) to its place in the step before is dropped (the "
        "authors' scripts: 0.5)",
        low=-1.0,
        high=1.0,
    )


def changed_tokens(tokens: StepTokens, threshold: float) -> Reduced:
    keep = similarity_to_previous(tokens.grid, tokens.previous) <= threshold
    return Reduced(keep=keep, grid=tokens.grid)


def reduce(params: DTDParams, tokens: StepTokens) -> Reduced:
    return changed_tokens(tokens, params.drop_threshold)


REDUCER = Reducer(
    name="dtd",
    description="drop tokens that barely changed since the step before (training-free)",
    paper=Paper(
        "TimeChat-Online: 80% Visual Tokens are Naturally Redundant in Streaming Videos",
        2025,
        "https://arxiv.org/abs/2504.17343",
    ),
    params=DTDParams,
    reduce=reduce,
    temporal=True,
    tower_attention=False,
)
