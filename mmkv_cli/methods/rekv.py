"""ReKV (the retrieval baseline of MuKV): the whole stream kept, one block per frame (temporal step)
with its mean key before RoPE as representative; at ask the top-k blocks by the question's mean
query before RoPE, in time order. As the authors' code does, each layer picks its own blocks from
its own keys and queries by a raw dot product, inside the answering forward: layer l's query has
seen what the layers below it retrieved. The paper's reading (preset rekv-paper) takes the
question's vectors from a forward of their own first and lets the last layer's choose for every
layer, by cosine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll, slide_window
from mmkv_cli.methods.retrieval import RetrievalContext, RetrievalOptions
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import retrieval_key


@dataclass(frozen=True)
class ReKVParams(StreamParams):
    window_tokens: int | None = knob(
        15000,
        "encode attends to the init prompt and the newest this many visual tokens (ReKV's sliding "
        "window, n_local); null: the whole stream",
        low=1,
    )
    k: int = knob(64, "frame blocks retrieved per question", low=1)
    query: Literal["query_mean", "last_key"] = knob(
        "query_mean", "question vector: mean of its last-layer queries, or its last token's key"
    )
    positions: Literal["keep", "reindex"] = knob(
        "keep", "keep the stored positions at ask, or compact them (keys re-rotated)"
    )
    similarity: Literal["dot", "cosine"] = knob(
        "dot",
        "question against representative: dot product (the authors' code, which calls it cosine "
        "similarity) or cosine (the paper)",
    )
    layers: Literal["each", "last"] = knob(
        "each",
        "each: every layer picks its own k blocks with its own vectors (the authors' code; stores "
        "a key per layer); last: the last layer's vectors choose the blocks of every layer",
    )
    retrieve: Literal["in_forward", "two_pass"] = knob(
        "in_forward",
        "in_forward: each layer retrieves inside the answering forward, by the question's query "
        "there (the authors' code; needs layers: each); two_pass: a forward of the question "
        "alone gives every layer's vector first",
    )

    chunk_size: int = knob(
        1,
        "frames retrieved together: runs of this many frames score their mean and the best "
        "k / chunk_size runs are taken whole (the code's retrieve_chunk_size; 1: frame by frame)",
        low=1,
    )

    def __post_init__(self) -> None:
        if self.k % self.chunk_size:
            raise UsageError(
                f"k ({self.k}) must be a multiple of chunk_size ({self.chunk_size}): k / "
                "chunk_size runs of frames are retrieved"
            )
        if self.retrieve == "in_forward" and self.layers != "each":
            raise UsageError(
                "retrieve: in_forward needs layers: each (the last layer's vector is known only "
                "after the forward; set retrieve: two_pass)"
            )


class ReKVMemory(KeepAll):
    """Every token goes into the pack, but encoding attends over a sliding window: older entries are
    moved out of the running cache, so encode cost grows linearly with the video."""

    seals_as_prefilled = True  # moved out of attention, never changed

    def after_chunk(self, state: StreamState) -> None:
        slide_window(state, self.params.window_tokens)

    def representative(self, keys, positions, rope):
        if self.params.layers == "each":
            return retrieval_key(keys, positions, rope)
        return super().representative(keys, positions, rope)


def context(params: ReKVParams) -> RetrievalContext:
    return RetrievalContext(
        RetrievalOptions(
            k={"frame": params.k},
            chunk=params.chunk_size,
            query=params.query,
            positions=params.positions,
            similarity=params.similarity,
            layers=params.layers,
            when="in_forward" if params.retrieve == "in_forward" else "before",
        )
    )


METHOD = Method(
    name="rekv",
    label="ReKV",
    description="whole stream, one block per frame, top-k retrieval by the question",
    start_here="a long video whose questions each need a few moments of it",
    paper=Paper(
        "Streaming Video Question-Answering with In-context Video KV-Cache Retrieval (ReKV)",
        2025,
        "https://arxiv.org/abs/2503.00540",
    ),
    params=ReKVParams,
    budget=None,
    streaming=ReKVMemory,
    context=context,
)
