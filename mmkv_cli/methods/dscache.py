"""DSCache (ICML 2026, arXiv 2605.01858): a past cache and an instant cache, decoupled. Following
the authors' code (pangzhan27/DSCache, `DSCache/StreamingBench_last.py` and
`DSCache/llava_ov/long_function.py`):

- the newest `frame_len` + 1 frames wait in a buffer; at the question they are prefilled fresh,
  right after the prompt, attending to nothing before them (the instant cache);
- a frame leaving the buffer is prefilled, one at a time, into the past cache after everything it
  holds; the past cache keeps its newest `context_len` + 1 frames (the oldest goes first), and a new
  frame is placed right after what the cache holds, whatever left it (position-agnostic: in a
  running stream every new frame takes the same places);
- at the question: the prompt, the past cache (every `past_stride`-th frame), the
  instant cache, then the question, placed after all of them (the README's `--continuous`).

The memory policy here is the past cache's; the encoder prefills the instant frames and joins the
two (encode/decoupled.py: `Method.instant`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState


@dataclass(frozen=True)
class DSCacheParams(StreamParams):
    chunk_frames: int = knob(
        1, "frames prefilled into the past cache per forward (the code caches one at a time)",
        low=1,
    )  # fmt: skip
    context_len: int = knob(
        16, "the past cache holds this many frames plus one (context_len: 16 in the README's "
        "command)", low=0,
    )  # fmt: skip
    frame_len: int = knob(
        4, "the instant cache holds the newest this many frames plus one, prefilled fresh at the "
        "question (frame_len)", low=0,
    )  # fmt: skip
    past_stride: int = knob(
        1, "the question reads every Nth frame of the past cache, from its (count - N) % N-th "
        "(ltype ls_N; the README's ls_1 reads all)", low=1,
    )  # fmt: skip


def newest_steps(steps: torch.Tensor, keep: int) -> torch.Tensor:
    """Local indices (ascending) of the entries of the `keep` newest steps among `steps` [n]."""
    distinct = torch.unique(steps)
    return (
        (steps >= distinct[-keep]).nonzero()[:, 0]
        if len(distinct) > keep
        else torch.arange(len(steps))
    )


def every_nth_step(steps: torch.Tensor, stride: int) -> torch.Tensor:
    """Local indices of the entries of every `stride`-th step among `steps` [n], from the
    (count - stride) % stride-th (`sample_long_cache`)."""
    distinct = torch.unique(steps)
    if stride <= 1 or len(distinct) < stride:
        return torch.arange(len(steps))
    chosen = distinct[(len(distinct) - stride) % stride :: stride]
    return torch.isin(steps, chosen).nonzero()[:, 0]


class DSCachePast(KeepAll):
    """The past cache: its newest context_len + 1 frames; what comes next is placed right after
    what it holds."""

    seals_as_prefilled = False

    def after_chunk(self, state: StreamState) -> None:
        frames_kept = self.params.context_len + 1
        steps_kept = max(1, -(-frames_kept // max(1, state.frames_per_step)))
        held = state.cache.index[0]
        local = newest_steps(state.token_step[held], steps_kept)
        if len(local) < len(held):
            for layer in range(state.layers):
                state.cache.retain(layer, local)
        # the next frame goes where the held frames would end in a fresh stream
        count = state.cache.count(0)
        placed = state.layout_positions[0]
        state.shift = int(placed[min(state.seen, len(placed) - 1)] - placed[count])

    def finish(self, state: StreamState) -> None:
        held = state.cache.index[0]
        local = every_nth_step(state.token_step[held], self.params.past_stride)
        if len(local) < len(held):
            for layer in range(state.layers):
                state.cache.retain(layer, local)


METHOD = Method(
    name="dscache",
    label="DSCache",
    description="a sliding past cache placed without gaps, and the newest frames prefilled fresh",
    paper=Paper(
        "Decouple and Cache: KV Cache Construction for Streaming Video Understanding (DSCache)",
        2026,
        "https://arxiv.org/abs/2605.01858",
    ),
    params=DSCacheParams,
    budget=None,  # its frame counts size it: --budget does not apply
    streaming=DSCachePast,
    adaptive=True,
    instant=lambda params: params.frame_len + 1,
)
