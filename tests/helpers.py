"""Test-only helpers: inputs for one ordinary HF forward over [prompt + video + question], the
reference a pack's answer is compared against."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch


def steps_of(per_step: int, times: list[float]) -> list[tuple[float, float]]:
    """(first, last) frame time of every temporal step of frames sampled at these times."""
    return [
        (times[i], times[min(i + per_step, len(times)) - 1]) for i in range(0, len(times), per_step)
    ]


def reference_inputs(backbone, frames: np.ndarray, question: str, times: list[float]) -> dict:
    family = backbone.family
    b = backbone
    question_ids = b.question_ids(question)
    if family == "llava_onevision":
        n_video = len(frames) * b.tokens_per_step(frames.shape[1:3]) + 1
        ids = (
            b.text_ids(b.prompt.prefix)
            + [b.model.config.video_token_id] * n_video
            + b.text_ids(b.prompt.suffix_text)
            + question_ids
        )
        pixels = b.video_processor(videos=[frames], return_tensors="pt")["pixel_values_videos"]
        return {
            "input_ids": torch.tensor([ids], device=b.device),
            "pixel_values_videos": pixels.to(b.device, b.dtype),
        }
    video_id = b.model.config.video_token_id
    inputs = b.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)
    grid = inputs["video_grid_thw"]
    merge = b.video_processor.merge_size
    steps = steps_of(b.frames_per_step, times)
    extra = {}
    if family == "qwen3_vl":  # every step stamped "<t seconds>" inside vision start/end tokens
        h, w = (int(x) // merge for x in grid[0, 1:])
        ids = b.text_ids(b.prompt.prefix)
        for time in steps:
            before, after = b.step_markers(time)
            ids += before + [video_id] * (h * w) + after
    else:
        ids = b.text_ids(b.prompt.prefix) + [video_id] * (int(grid.prod()) // merge**2)
        extra = b._rope_kwargs(steps)
    ids = torch.tensor([ids + b.text_ids(b.prompt.suffix_text) + question_ids])
    return {
        "input_ids": ids.to(b.device),
        "mm_token_type_ids": ((ids == video_id).int() * 2).to(b.device),
        "pixel_values_videos": inputs["pixel_values_videos"].to(b.device, b.dtype),
        "video_grid_thw": grid.to(b.device),
        **extra,
    }


def choose(name: str, budget=None, budget_tokens=None, **params):
    """The method `name` as the CLI would resolve it, with some parameters overridden."""
    from mmkv_cli.core.spec import override
    from mmkv_cli.methods.choice import resolve_method

    choice = resolve_method(name).with_budget(budget, budget_tokens)
    return replace(choice, params=override(choice.params, params, "test")) if params else choice


def with_policy(choice, policy):
    """`choice` whose streaming memory is the given policy object (to watch it while it runs)."""
    return replace(choice, method=replace(choice.method, streaming=lambda *_: policy))


def encode_pack(media, output, model=None, method="full", budget=None, *, backbone=None, **options):
    """api.encode with the options spelled as keywords (the tests' shorthand)."""
    from mmkv_cli import api
    from mmkv_cli.core.options import EncodeOptions, LoadOptions

    return api.encode(
        str(media),
        output,
        EncodeOptions(method, budget, **options),
        backbone=backbone,
        load=LoadOptions(model, "cpu"),
    )


def ask_pack(pack, question, *, backbone=None, max_new_tokens=32, keep_logits=False, **options):
    """api.ask with the options spelled as keywords (budget: the --prune budget)."""
    from mmkv_cli import api
    from mmkv_cli.core.options import AskOptions, GenerationOptions, Positions

    if options.get("positions") is not None:
        options["positions"] = Positions(options["positions"])
    if "budget" in options:
        options["prune_budget"] = options.pop("budget")
    asking = AskOptions(
        generation=GenerationOptions(max_new_tokens), keep_logits=keep_logits, **options
    )
    return api.ask(pack, question, asking, backbone=backbone)


@contextmanager
def serving(packs: str, *extra: str, runtime: str | None = None):
    """`mmkv serve --packs PACKS [EXTRA...]` in its own process on a free loopback port, without
    an API key; yields its base URL once /health answers, and stops it afterwards. Its local
    channel is in `runtime` (default: a folder of its own, so no other test's command uses it)."""
    import httpx
    import pytest

    from tests.conftest import ROOT

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (an access line a request: never a full pipe)
    private = tempfile.mkdtemp(prefix="msv-", dir="/tmp")
    process = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "serve", "--packs", packs, "--port", str(port)]
        + ["--device", "cpu", *extra],
        cwd=ROOT,
        env={**os.environ, "MMKV_API_KEY": "", "XDG_RUNTIME_DIR": runtime or private},
        stdout=subprocess.DEVNULL,
        stderr=log,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            process.kill()
            log.seek(0)
            pytest.fail(f"server did not start: {log.read()}")
        yield base
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()
        shutil.rmtree(private, ignore_errors=True)


def pack_header(layers=3, dtype="float32", heads=2, dim=8, **sections):
    """A typed pack header for tests that write packs by hand (model 'm', method full)."""
    from mmkv_cli.pack.schema.header import Fingerprint, KVShape, MethodRecord, PackHeader

    return PackHeader(
        kv=KVShape(layers, heads, dim, dtype),
        fingerprint=sections.pop("fingerprint", Fingerprint(model="m")),
        method=sections.pop("method", MethodRecord(name="full", budget=1.0)),
        **sections,
    )


def mpegts_bytes(video) -> bytes:
    """The video's packets remuxed as MPEG-TS (what ffmpeg or a camera tool pipes)."""
    import io

    import av

    out_buffer = io.BytesIO()
    with av.open(str(video)) as source, av.open(out_buffer, mode="w", format="mpegts") as out:
        stream = source.streams.video[0]
        copied = out.add_stream_from_template(stream)
        for packet in source.demux(stream):
            if packet.dts is None:
                continue
            packet.stream = copied
            out.mux(packet)
    return out_buffer.getvalue()


def run_mmkv(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """`mmkv ARGS` in a fresh process (at 200 columns unless `env` says), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        cwd=cwd,
        timeout=300,
    )


def capped_rows(address: int, count: int, cap: int) -> np.ndarray:
    """The `count` pieces of a `vectored.table` at `address`, cut after their first `cap` bytes:
    what a preadv that reads at most `cap` bytes fills (a copy)."""
    import ctypes

    from mmkv_cli.pack.io.vectored import IOVEC

    width = np.dtype(IOVEC).itemsize
    rows = np.frombuffer((ctypes.c_char * (count * 2 * width)).from_address(address), IOVEC)
    rows = rows.reshape(count, 2).copy()
    ends = np.cumsum(rows[:, 1].astype(np.int64))
    keep = min(count, int(np.searchsorted(ends, cap)) + 1)
    rows = rows[:keep].copy()
    rows[-1, 1] -= max(0, int(ends[keep - 1]) - cap)
    return rows


def watched(memory_class):
    """`memory_class` recording what a test checks it against its definition with: each chunk's
    grid tokens as embedded (`frames`: a step's stream indices and float64 embeddings), every
    entry's K and V the first time the cache held it (`before`, layer 0), and at the end the stream
    indices the cache holds (`kept`) with layer 0's K and V (`held`)."""

    class Watched(memory_class):
        def __init__(self, *args):
            super().__init__(*args)
            self.frames, self.before = [], {}

        def after_chunk(self, state):
            for index, row in zip(state.chunk_index, state.chunk_grid):
                self.frames.append((index.clone(), row.double().clone()))
            keys, values = state.cache.visual(0)
            for local, index in enumerate(state.cache.index[0].tolist()):
                self.before.setdefault(index, (keys[:, local].clone(), values[:, local].clone()))
            super().after_chunk(state)

        def finish(self, state):
            super().finish(state)
            self.kept = state.cache.index[0].tolist()
            self.held = state.cache.visual(0)

    return Watched
