"""StreamingTOM (arXiv 2510.18269): fewer tokens before the language model, then an online quantized
memory read back on demand. Following the authors' code (YIGE24/StreamingTOM):
- before the prefill, Causal Temporal Reduction keeps a fixed number of tokens a frame (the `ctr`
  reducer, the method's own: 50 of LLaVA-OV's 196);
- encode attends to the init prompt and a sliding window of the newest 4800 visual tokens; every
  frame's kept tokens go into the pack, 4-bit (OQM_QUANTIZATION_BITS=4);
- at ask, every layer retrieves its own frames by the cosine of the question's mean query (over its
  tokens and each KV group's heads, before RoPE) with each frame's mean key before RoPE, enough
  frames for 12544 tokens (12544 / 50 = 251 frames), re-rotated to consecutive places after the
  init prompt (`_retrieve_mode` in streamingtom/modules/attention_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll, slide_window
from mmkv_cli.methods.retrieval import RetrievalContext, RetrievalOptions
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import retrieval_key


@dataclass(frozen=True)
class StreamingTOMParams(StreamParams):
    window_tokens: int | None = knob(
        4800,
        "encode attends to the init prompt and the newest this many visual tokens "
        "(OQM_SLIDING_WINDOW_SIZE); null: the whole stream",
        low=1,
    )
    retrieve_frames: int = knob(
        251,
        "frames each layer retrieves per question (the scripts' 12544 tokens of 50-token frames)",
        low=1,
    )
    positions: Literal["reindex", "keep"] = knob(
        "reindex",
        "reindex: retrieved keys re-rotated to consecutive places after the init prompt (the "
        "authors' code); keep: their stored places",
    )


class StreamingTOMMemory(KeepAll):
    """Every prefilled token goes into the pack (the reducer already chose them); encode attends
    over a sliding window; a frame's retrieval key is kept per layer."""

    seals_as_prefilled = True  # moved out of attention, never changed

    def after_chunk(self, state: StreamState) -> None:
        slide_window(state, self.params.window_tokens)

    def representative(self, keys, positions, rope):
        return retrieval_key(keys, positions, rope)  # every layer's: each retrieves its own


def context(params: StreamingTOMParams) -> RetrievalContext:
    return RetrievalContext(
        RetrievalOptions(
            k={"frame": params.retrieve_frames},
            query="query_mean",
            positions=params.positions,
            similarity="cosine",
            layers="each",
        )
    )


METHOD = Method(
    name="streamingtom",
    label="StreamingTOM",
    description="a fixed count of tokens a frame before the LM, a 4-bit memory, frames retrieved",
    paper=Paper(
        "StreamingTOM: Streaming Token Compression for Efficient Video Understanding",
        2025,
        "https://arxiv.org/abs/2510.18269",
    ),
    params=StreamingTOMParams,
    budget=None,  # the reducer sets the size: every token it lets through is stored
    streaming=StreamingTOMMemory,
    context=context,
    reducer="ctr",
    kv_bits=4,
)
