"""simplestream (SimpleStream, arXiv 2604.02317): no memory at all. The model sees only the newest
N frames of the stream, prefilled fresh right after the prompt, whatever came before them: the
control a streaming memory is asked to beat (the authors' `query_recent_window` decodes the video at
its fps and feeds the last N one-frame chunks to the model with the question).

The frames are chosen before the encode (encode/encoder.py, encode/live.py: `Method.window`); what
they give is kept whole, as `full` keeps it. A pack of a whole video holds its last N frames, so a
question `--at` an earlier moment sees none of them: ask the pack of the stream cut there (what
`mmkv live` and `mmkv eval --protocol stream` do)."""

from __future__ import annotations

from dataclasses import dataclass

from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Method, Paper, StreamParams
from mmkv_cli.methods.keep_all import KeepPrefilled


@dataclass(frozen=True)
class SimpleStreamParams(StreamParams):
    frames: int = knob(
        4, "the newest frames the model sees, prefilled fresh (recent_frames_only; 4 in the paper)",
        low=1, high=4096,
    )  # fmt: skip


METHOD = Method(
    name="simplestream",
    label="SimpleStream",
    description="no memory: the newest frames alone, prefilled fresh (the recency control)",
    paper=Paper(
        "A Simple Baseline for Streaming Video Understanding (SimpleStream)",
        2026,
        "https://arxiv.org/abs/2604.02317",
    ),
    params=SimpleStreamParams,
    budget=None,
    streaming=KeepPrefilled,  # the window's frames, every token as prefilled
    window=lambda params: params.frames,
)
