"""bench/gpu.py's read part: a pack at LLaVA-OV-7B width read from the page cache as mmkv reads it
(a fresh open and `gather`, `verify`, ReKV's layers inside the forward, StreamingTOM's and
HERMES's questions), onto the host and onto the device."""

from __future__ import annotations

import os
import time
from pathlib import Path

READ_PICKS = 64  # ReKV's k: the blocks each layer reads inside the forward


def read(work: Path, blocks: int, device: str) -> dict:
    """GB/s of a fresh open and `gather` of every block (checksums and NaN/Inf checks included)
    onto the host and onto `device` (pinned groups of layers sent while the next is read), and of
    `verify`, best of 3, from the page cache."""
    from rates import best_rate, layer_reads, seven_b_pack

    from mmkv_cli.pack import PackReader
    from mmkv_cli.pack.access.report import verify

    path = work / "read.kvpack"
    names = seven_b_pack(path, blocks)
    size = path.stat().st_size
    return {
        "pack_bytes": size,
        "cpus": os.cpu_count(),
        "fresh_gather_gb_s": best_rate(size, lambda: PackReader(path).gather(names), 3),
        "fresh_gather_to_device_gb_s": best_rate(size, lambda: on_device(path, names, device), 3),
        "verify_gb_s": best_rate(size, lambda: verify(path), 3),
        **transfers(device),
        # ReKV inside the forward: 28 layers, each its k = 64 blocks, one digest a block against
        # one a layer (K/V of the same shape; the second pack keeps a retrieval key a layer), read
        # as a question does (checksums left to finish on many cores) and each checked at once
        "layer_reads_picks": min(READ_PICKS, blocks),
        "layer_reads_block_digests_s": layer_reads(path, names, device, min(READ_PICKS, blocks), 3),
        **keyed_reads(keyed(work, blocks), names, device, min(READ_PICKS, blocks)),
        **small_units(streamingtom_shaped(work), device),
        **hermes_question(work, device),
    }


def hermes_question(work: Path, device: str) -> dict:
    """HERMES's question read: 512 frames of 8 tokens a layer at 7B width (236 MB, a digest a
    block), every block onto the host and onto `device`, as a question reads (checksums left to
    finish beside it on many cores): the third H100 run's read phase was 0.143 s of a 0.187 s
    TTFT, against a goal of 0.12 s."""
    from rates import gather_seconds, seven_b_pack

    path = work / "hermes.kvpack"
    names = seven_b_pack(path, 512, tokens=8)
    out = {"hermes_read_bytes": path.stat().st_size}
    for label, where in (("host", "cpu"), ("device", device)):
        out[f"hermes_question_read_{label}_s"] = gather_seconds(path, names, where, 3, True)
    return out


def keyed_reads(path: Path, names: list[str], device: str, picks: int) -> dict:
    from rates import layer_reads

    return {
        "layer_reads_layer_digests_s": layer_reads(path, names, device, picks, 3),
        "layer_reads_checked_at_once_s": layer_reads(path, names, device, picks, 3, False),
    }


def small_units(path: Path, device: str) -> dict:
    """StreamingTOM's pack (512 frames of 50 tokens, 4-bit, 27 KB digest units): its question
    (251 frames a layer) and `verify`, with units that small hashed on one thread (as mmkv does)
    and on the hashing threads (PARALLEL_HASH_BLOCK_BYTES lowered): whether one thread still wins
    on this machine's cores."""
    from rates import best_rate, layer_picks

    from mmkv_cli.pack.access.report import verify
    from mmkv_cli.pack.integrity import hashing

    names, size, out = [f"b{i}" for i in range(512)], path.stat().st_size, {}
    threshold = hashing.PARALLEL_HASH_BLOCK_BYTES
    for label, at in (("", threshold), ("_threads", 0)):
        hashing.PARALLEL_HASH_BLOCK_BYTES = at
        try:
            out[f"layer_picks_4bit{label}_s"] = layer_picks(path, names, device, 251, 3)
            if not label:  # as a question: its checksums finish beside (8 cores or more)
                question = layer_picks(path, names, device, 251, 3, question=True)
                out["layer_picks_4bit_question_s"] = question
            out[f"verify_4bit_small_units{label}_gb_s"] = best_rate(size, lambda: verify(path), 3)
        finally:
            hashing.PARALLEL_HASH_BLOCK_BYTES = threshold
    return out


def streamingtom_shaped(work: Path) -> Path:
    """A pack shaped as StreamingTOM's at 7B: 512 frames of 50 tokens, 4-bit, a key a layer."""
    from rates import seven_b_pack

    path = work / "streamingtom.kvpack"
    seven_b_pack(path, 512, retrieval_keys=True, tokens=50, bits=4)
    return path


def keyed(work: Path, blocks: int) -> Path:
    """The read part's pack again, each block with a retrieval key per layer (a digest a layer)."""
    from rates import seven_b_pack

    path = work / "keyed.kvpack"
    seven_b_pack(path, blocks, retrieval_keys=True)
    return path


def transfers(device: str) -> dict:
    """What a read bound for the GPU pays besides the file: pinning 256 MiB (a fresh buffer, then
    one the caching host allocator hands back) and copying it to the device, pinned and pageable."""
    import torch
    from rates import best_rate

    if torch.device(device).type != "cuda":
        return {}
    size, out = 256 << 20, {}
    for name in ("pin_first_s", "pin_again_s"):
        began = time.perf_counter()
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        out[name] = round(time.perf_counter() - began, 4)
        del buffer
    target = torch.empty(size, dtype=torch.uint8, device=device)
    for name, pinned in (("h2d_pinned_gb_s", True), ("h2d_pageable_gb_s", False)):
        source = torch.ones(size, dtype=torch.uint8, pin_memory=pinned)

        def copy(source=source):
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()

        out[name] = best_rate(size, copy, 5)
    return out


def on_device(path: Path, names: list[str], device: str) -> None:
    import torch

    from mmkv_cli.pack import PackReader

    PackReader(path).gather(names, None, device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
