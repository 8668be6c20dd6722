"""profile: encode time, pack bytes, tokens kept, peak memory, ask TTFT and decode time, method
against method."""

from __future__ import annotations

import itertools
import os
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from mmkv_cli import api
from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
from mmkv_cli.methods.choice import resolve_method
from mmkv_cli.pack import QuantSpec

METRICS = [
    "encode_s",
    "bytes",
    "visual_tokens_kept",
    "peak_mem_bytes",
    "peak_kv_bytes",
    "ttft_s",
    "decode_s_per_token",
]


class PeakMemory:
    """Peak memory over a block: CUDA allocator peak on GPU, sampled process RSS growth on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def _rss() -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _sample(self, base: int) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss() - base)

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._thread = threading.Thread(target=self._sample, args=(self._rss(),), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._stop.set()
            self._thread.join()
        return False


def profile(
    media: str,
    methods: list[str],
    options: EncodeOptions,
    question: str = "what happened first?",
    max_new_tokens: int = 16,
    load: LoadOptions | None = None,
    progress=None,
    kv_bits: list[int] | None = None,
    repeat: int = 1,
) -> dict:
    """Encode `media` per method and per stored bits (options.budget for every compressing
    method, each method's own otherwise), ask `question` from each pack, and compare everything
    with full's figures at the first bits. Each is run `repeat` times after one unmeasured warm-up
    and reported by its medians (one cold run moves by several times on a busy machine). Each
    quantized pack's first answer token is compared with the same method's pack at the first bits
    listed (KL divergence, top-1 agreement)."""
    if not methods:
        raise UsageError("--methods needs at least one method")
    if repeat < 1:
        raise UsageError("--repeat must be at least 1")
    kv_bits = kv_bits or [16]
    choices = {name: resolve_method(name) for name in methods}  # unknown names fail before loading
    for bits in kv_bits:
        QuantSpec(bits, options.kv_group).check(1, 8)
    backbone = load_backbone(load)
    asking = AskOptions(
        generation=GenerationOptions(max_new_tokens=max_new_tokens), keep_logits=True
    )
    rows = []
    logits: dict[str, torch.Tensor] = {}  # each method's first answer logits at the first bits

    def encode_options(name: str, **extra) -> EncodeOptions:
        budget = options.budget if choices[name].method.takes_budget else None
        return replace(options, method=name, budget=budget, force=True, **extra)

    with tempfile.TemporaryDirectory(prefix="mmkv-profile-") as tmp:
        # One short unmeasured run first, so lazy imports and first-call allocations land on no
        # method.
        warm = Path(tmp) / "warmup.kvpack"
        api.encode(media, warm, encode_options(methods[0], max_frames=2), backbone=backbone)
        api.ask(warm, question, AskOptions(generation=GenerationOptions(2)), backbone=backbone)
        for name, bits in itertools.product(methods, kv_bits):
            pack = Path(tmp) / f"{name}-{bits}.kvpack"
            runs = []
            for _ in range(repeat):
                with PeakMemory(backbone.device) as mem:
                    made = encode_options(name, kv_bits=bits)
                    summary = api.encode(media, pack, made, backbone=backbone)
                answer = api.ask(pack, question, asking, backbone=backbone)
                runs.append((summary, answer, mem.peak))
            summary, answer, _ = runs[0]
            timed = {
                "encode_s": _median([run[0]["encode_s"] for run in runs]),
                "peak_mem_bytes": _median([run[2] for run in runs]),
                "ttft_s": _median([run[1].ttft_s for run in runs]),
                "decode_s_per_token": _median([run[1].decode_s_per_token for run in runs]),
            }
            first = logits.setdefault(name, answer.first_logits)
            rows.append(
                {
                    "method": name,
                    "kv_bits": bits,
                    **first_token_change(first, answer.first_logits),
                    "budget": summary["budget"],
                    "budget_tokens": summary["budget_tokens"],
                    "bytes": summary["bytes"],
                    "visual_tokens_kept": summary["visual_tokens_kept"],
                    "visual_tokens_total": summary["visual_tokens_total"],
                    "peak_kv_bytes": summary["peak_kv_bytes"],
                    **timed,
                    "repeat": repeat,
                    "answer": answer.answer,
                }
            )
            if progress:
                progress(name)
    reference = next(
        (r for r in rows if r["method"] == "full" and r["kv_bits"] == kv_bits[0]), rows[0]
    )
    for row in rows:
        row["ratio"] = {m: _ratio(row[m], reference[m]) for m in METRICS}
    return {
        "model": backbone.name,
        "device": str(backbone.device),
        "media": media,
        "question": question,
        "reference": reference["method"],
        "reference_kv_bits": reference["kv_bits"],
        "methods": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _median(values: list) -> float | None:
    """The median of the values measured (None where none was: a one-token answer's decode)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(value, reference) -> float | None:
    return value / reference if value is not None and reference else None


# what each measured figure is called where people read it (the plot's panels)
IN_WORDS = {
    "encode_s": "encode time",
    "bytes": "pack size",
    "peak_mem_bytes": "peak memory while encoding",
    "ttft_s": "time to first token",
    "decode_s_per_token": "decode time per token",
}


def label(row: dict) -> str:
    """A run named by its method, its budget (as a share or tokens) and its bits."""
    name = row["method"]
    if row.get("budget_tokens"):
        name += f" @{row['budget_tokens']} tok"
    elif row.get("budget") not in (None, 1.0):
        name += f" @{row['budget']:g}"
    return name if row.get("kv_bits", 16) == 16 else f"{name} {row['kv_bits']}-bit"


def first_token_change(reference: torch.Tensor, logits: torch.Tensor) -> dict:
    """How far a pack's first answer token distribution moved from a reference pack's: KL(ref ||
    this) in nats, and whether the most likely token is the same."""
    ref, mine = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    kl = torch.nn.functional.kl_div(mine, ref, log_target=True, reduction="sum")
    return {"first_token_kl": float(kl), "top1_agrees": bool(ref.argmax() == mine.argmax())}


def plot(result: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [label(r) for r in result["methods"]]
    shown = [m for m in IN_WORDS if any(r["ratio"][m] is not None for r in result["methods"])]
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], shown):
        values = [r["ratio"][metric] or 0.0 for r in result["methods"]]
        ax.bar(names, values, color="#4c72b0")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{IN_WORDS[metric]}, ÷ {result['reference']}'s", fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"mmkv profile: {result['model']} on {Path(result['media']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
