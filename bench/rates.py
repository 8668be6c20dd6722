"""Read rates of a pack at LLaVA-OV-7B width, shared by bench/fuzz.py and bench/gpu.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

LAYERS, HEADS, DIM, TOKENS = 28, 4, 128, 196  # Qwen2-7B's KV, 196 visual tokens a frame


def seven_b_pack(
    path: Path, blocks: int, retrieval_keys: bool = False, tokens: int = TOKENS, bits: int = 16
) -> list[str]:
    """A pack of `blocks` frames of `tokens` at 7B width (float16, random K/V, stored at `bits`)
    at `path`; its block names. retrieval_keys: every block a key per layer, as ReKV's and
    StreamingTOM's (so a digest a layer, v12)."""
    import torch

    from mmkv_cli.pack import Span, write_pack
    from mmkv_cli.pack.quantized.quant import QuantSpec
    from tests.helpers import pack_header

    g = torch.Generator().manual_seed(0)

    def span(name: str, n: int, kind: str | None = None) -> Span:
        kv = [torch.randn(HEADS, n, DIM, generator=g).half() for _ in range(2 * LAYERS)]
        steps = (0, 1) if kind else None
        positions = [torch.arange(n)[None]] * LAYERS
        key = torch.randn(LAYERS, HEADS * DIM, generator=g).half() if retrieval_keys else None
        return Span(name, kv[:LAYERS], kv[LAYERS:], positions, granularity=kind, steps=steps,
                    representative=key if kind else None)  # fmt: skip

    body = [span(f"b{i}", tokens, "frame") for i in range(blocks)]
    header = pack_header(LAYERS, "float16", heads=HEADS, dim=DIM)
    quant = QuantSpec(bits) if bits != 16 else None
    write_pack(path, header, span("prefix", 4), body, span("suffix", 2), quant=quant)
    return [b.name for b in body]


def best_seconds(work: Callable[[], object], device: str, tries: int) -> float:
    """Seconds of the fastest of `tries` runs of `work` (a read: a fresh open each), the device's
    copies waited for."""
    import torch

    best = float("inf")
    for _ in range(tries):
        began = time.perf_counter()
        work()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return round(best, 4)


def gather_seconds(path: Path, names: list[str], device: str, tries: int, question=False) -> float:
    """A fresh open and gather of every layer's rows of `names`, best of `tries`; as a question
    reads (`question`: checksums left to finish on many cores, waited for at the end)."""
    from mmkv_cli.pack import PackReader
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    def read() -> None:
        later = LaterVerdicts(str(path)) if question else None
        PackReader(path).gather(names, device=device, later=later)
        if later is not None:
            later.check_reads()

    return best_seconds(read, device, tries)


def best_rate(size: int, work: Callable[[], object], tries: int) -> float:
    """GB/s of `size` bytes over the fastest of `tries` runs of `work`."""
    times = []
    for _ in range(tries):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return round(size / min(times) / 1e9, 2)


def layer_reads(
    path: Path, names: list[str], device: str, picks: int, tries: int, question: bool = True
) -> float:
    """Seconds (best of `tries`, a fresh open each) of ReKV's reading inside the forward: each
    layer in turn reads its own `picks` blocks (random, the same every run), its rows alone. As a
    question reads (`question`), a layer's checksums may finish while the next layer is read, and
    every one is waited for at the end, where the first token would be."""
    import numpy as np

    from mmkv_cli.pack import PackReader
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    rng = np.random.default_rng(0)
    chosen = [sorted(rng.choice(len(names), picks, replace=False).tolist()) for _ in range(LAYERS)]

    def read() -> None:
        reader = PackReader(path)
        later = LaterVerdicts(str(path)) if question else None
        for layer, picked in enumerate(chosen):
            taken = [names[i] for i in picked]
            only = [taken if i == layer else [] for i in range(LAYERS)]
            reader.gather(taken, only, device, later=later)
        if later is not None:
            later.check_reads()

    return best_seconds(read, device, tries)


def layer_picks(
    path: Path, names: list[str], device: str, picks: int, tries: int, question: bool = False
) -> float:
    """Seconds (best of `tries`, a fresh open each) of a per-layer retrieval's one read
    (StreamingTOM's; ReKV's two-pass): every layer its own `picks` blocks (random, the same every
    run), each checked by its layer's digests, decoded on `device`. As a question reads
    (`question`): the checksums may finish after the read, waited for at the end."""
    import numpy as np

    from mmkv_cli.pack import PackReader
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    rng = np.random.default_rng(0)
    chosen = [sorted(rng.choice(len(names), picks, replace=False).tolist()) for _ in range(LAYERS)]
    union = [names[i] for i in sorted(set().union(*chosen))]
    per_layer = [[names[i] for i in picked] for picked in chosen]

    def read() -> None:
        later = LaterVerdicts(str(path)) if question else None
        PackReader(path).gather(union, per_layer, device, later=later)
        if later is not None:
            later.check_reads()

    return best_seconds(read, device, tries)
