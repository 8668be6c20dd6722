"""Quantized packs (issues 15, 38): size, answer drift, accuracy and ask latency at 8, 4, 2 and
1.5 bits (VidKV's mixed keys and ternary values).

    python bench/quant.py [--frames 16] [--ttft-frames 128] [--ttft-layers 2] [--clips 12]

1. Size at real widths: rehearsal LLaVA-OV-0.5B (2 KV heads x 64, all 24 layers) and 7B (4 x 128,
   4 of its 28 layers: the 7B weights would not fit this machine) in bf16, full, recency at 0.1
   and mukv at 0.1 (patch blocks of about 5 tokens), and the demo backbone (4-token frames, fp32
   KV) full and recency at 0.1; the 16-bit pack converted to 8/4/2 bits with key groups (spanning
   the blocks of a layer, v9) of 32, 64 and 128 tokens: pack bytes / 16-bit pack bytes at the
   KV's own 16 bits (the demo's fp32 pack counts as half its bytes), and the 16-bit pack's bytes /
   its physical KV (tokens held x layers x 2 x heads x head dim x 2 bytes). The prompt's KV stays
   as computed and positions are stored whole, which weighs on short or heavily pruned packs, so
   `kv_*` is the blocks' K/V alone: codes and both scales / the same tokens at 16 bits.
2. Answer drift on the demo backbone (fp32 KV as computed): the first answer token's KL divergence
   and top-1 agreement against the unquantized pack, over the sample clip and a fresh synthetic set.
3. `mmkv eval` accuracy at 16/8/4/2 bits on the same fresh clips (full and mukv).
4. Ask TTFT from an 8/4/2/1.5-bit pack / from the bf16 pack, rehearsal 0.5B on the CPU (the whole
   stream read and dequantized: full keeps every block).
5. The host's quantizing rate, as a pack is written (also while a GPU encodes): 12 random frames
   of 196 tokens at 7B width (28 layers x 4 KV heads x 128, float16) through the writer's
   KeyScales at each bit width, best of 5, in MB of float16 K/V a second.
Writes bench/results/quant.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmkv_cli import api  # noqa: E402
from mmkv_cli.backbones.loading import load_backbone  # noqa: E402
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions  # noqa: E402
from mmkv_cli.pack import Span  # noqa: E402
from mmkv_cli.pack.access.block_writing import KeyScales  # noqa: E402
from mmkv_cli.pack.access.convert import convert  # noqa: E402
from mmkv_cli.pack.integrity.checks import read_directory  # noqa: E402
from mmkv_cli.pack.quantized.quant import QuantSpec  # noqa: E402
from mmkv_cli.study.evaluate import EvalSettings, evaluate, load_items, prompt_for  # noqa: E402
from mmkv_cli.study.profile import first_token_change  # noqa: E402
from mmkv_cli.study.synth import write_dataset  # noqa: E402

BITS = (8, 4, 2, 1.5)
GROUPS = (32, 64, 128)
CLIP = ROOT / "samples" / "clip.mp4"
LOGITS = AskOptions(generation=GenerationOptions(max_new_tokens=1), keep_logits=True)


def block_kv_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the blocks' K/V codes and scales, the blocks' K/V elements) of a pack."""
    with open(path, "rb") as fh:
        entries = read_directory(fh, path)[0]
    size = sum(
        entries[f"blocks.{part}"]["data_offsets"][1] - entries[f"blocks.{part}"]["data_offsets"][0]
        for part in ("k", "v", "kq", "vq")
        if f"blocks.{part}" in entries
    )
    tokens, heads, _ = entries["blocks.k"]["shape"]
    return size, 2 * tokens * heads * entries["prefix.k"]["shape"][2]


def sizes(work: Path, video: Path, frames: int) -> list[dict]:
    rows = []
    subjects = (
        ("rehearsal-llava-ov-0.5b", None, "bfloat16", (("full", None), ("recency", 0.1))),
        ("rehearsal-llava-ov-7b", 4, "bfloat16", (("full", None), ("recency", 0.1), ("mukv", 0.1))),
        ("demo", None, "auto", (("full", None), ("recency", 0.1), ("mukv", 0.5))),
    )
    for model, layers, dtype, methods in subjects:
        # the demo's clips are 64 frames of 4 tokens: a 10% budget holds 26 tokens a layer there
        frames_here = max(frames, 64) if model == "demo" else frames
        backbone = load_backbone(LoadOptions(model, "cpu", dtype, layers=layers))
        kv = backbone.kv_shape()
        # the demo's KV is fp32: its ratios are against the same KV at 16 bits
        wide = 2 if kv["dtype"] == "float32" else 1
        for method, budget in methods:
            base = work / f"{model}-{method}-16.kvpack"
            options = EncodeOptions(method, budget, fps=2.0, max_frames=frames_here, force=True)
            info = api.encode(str(video), base, options, backbone=backbone)
            held = sum(layer["tokens_kept"] for layer in info["layers"])
            held += info["prompt_tokens"] * len(info["layers"])
            physical = held * 2 * kv["kv_heads"] * kv["head_dim"] * 2 * wide
            row = {
                "model": model,
                "kv": f"{kv['kv_heads']}x{kv['head_dim']}",
                "layers": kv["layers"],
                "method": method if budget is None else f"{method}@{budget}",
                "frames": frames_here,
                "bytes_16": info["bytes"],
                "overhead_16": info["bytes"] / physical,
            }
            for bits in BITS:
                for group in GROUPS:
                    out = work / f"{model}-{method}-{bits}-{group}.kvpack"
                    made = convert(base, out, QuantSpec(bits, group))["bytes"]
                    row[f"ratio_{bits}_g{group}"] = made * wide / info["bytes"]
                    kv_bytes, elements = block_kv_bytes(out)
                    row[f"kv_{bits}_g{group}"] = kv_bytes / (elements * 2)
                    out.unlink()
            rows.append(row)
            print(json.dumps(row), flush=True)
            base.unlink()
        del backbone
    return rows


def drift(work: Path, qa_file: Path) -> dict:
    """First-token KL and top-1 agreement, quantized vs unquantized, on the demo backbone."""
    backbone = load_backbone(LoadOptions("demo", "cpu"))
    items = load_items(qa_file)
    asked: dict[str, list[str]] = {str(CLIP): ["which shape appeared first ?"]}
    for item in items:
        asked.setdefault(item.video, []).append(prompt_for(item))
    out: dict[int, list[dict]] = {bits: [] for bits in BITS}
    for n, (video, questions) in enumerate(asked.items()):
        base = work / f"drift-{n}-16.kvpack"
        api.encode(video, base, EncodeOptions("full", force=True), backbone=backbone)
        packs = {16: api.PackSession(base, backbone=backbone)}
        for bits in BITS:
            path = work / f"drift-{n}-{bits}.kvpack"
            convert(base, path, QuantSpec(bits), force=True)
            packs[bits] = api.PackSession(path, backbone=backbone)
        for question in questions:
            reference = packs[16].ask(question, LOGITS).first_logits
            for bits in BITS:
                logits = packs[bits].ask(question, LOGITS).first_logits
                out[bits].append(first_token_change(reference, logits))
    return {
        bits: {
            "questions": len(rows),
            "kl_mean": statistics.fmean(r["first_token_kl"] for r in rows),
            "kl_max": max(r["first_token_kl"] for r in rows),
            "top1_agreement": statistics.fmean(r["top1_agrees"] for r in rows),
        }
        for bits, rows in out.items()
    }


def accuracy(work: Path, qa_file: Path) -> list[dict]:
    runs = []
    for bits in (16, *BITS):
        settings = EvalSettings(max_new_tokens=8, kv_bits=bits)
        result = evaluate(
            str(qa_file),
            ["full", "mukv"],
            [0.5],
            work / "eval",
            settings,
            LoadOptions("demo", "cpu"),
        )
        for run in result["runs"]:
            row = {k: run[k] for k in ("method", "budget", "kv_bits", "accuracy", "n")}
            runs.append(row)
            print(json.dumps(row), flush=True)
    return runs


def ttft(work: Path, video: Path, frames: int, layers: int) -> dict:
    backbone = load_backbone(LoadOptions("rehearsal-llava-ov-0.5b", "cpu", "bfloat16", layers))
    base = work / "ttft-16.kvpack"
    options = EncodeOptions("full", fps=2.0, max_frames=frames, force=True)
    api.encode(str(video), base, options, backbone=backbone)
    packs = {16: base}
    for bits in BITS:
        packs[bits] = work / f"ttft-{bits}.kvpack"
        convert(base, packs[bits], QuantSpec(bits), force=True)
    one = AskOptions(generation=GenerationOptions(max_new_tokens=1))
    times = {}
    for bits, pack in packs.items():
        session = api.PackSession(pack, backbone=backbone)
        session.ask("what happened first ?", one)  # warm: page cache, first allocations
        # a fresh reader per ask, as a new `mmkv ask` has: nothing verified or cached yet
        samples = [
            api.PackSession(pack, backbone=backbone).ask("what happened first ?", one).ttft_s
            for _ in range(7)
        ]
        times[bits] = {"ttft_s": statistics.median(samples), "bytes": pack.stat().st_size}
    return {
        "model": "rehearsal-llava-ov-0.5b",
        "layers": layers,
        "frames": frames,
        "tokens": frames * 196,
        "by_bits": times,
        **{f"ttft_ratio_{b}_over_16": times[b]["ttft_s"] / times[16]["ttft_s"] for b in BITS},
    }


def host_quantize(frames: int = 12, tokens: int = 196) -> dict:
    layers, heads, dim = 28, 4, 128
    g = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(frames):
        kv = [torch.randn(heads, tokens, dim, generator=g).half() for _ in range(2 * layers)]
        steps = (i, i + 1)
        positions = [torch.arange(tokens)[None] + i * tokens] * layers
        blocks.append(Span(f"b{i}", kv[:layers], kv[layers:], positions, "frame", steps))
    kv_mb = frames * tokens * layers * heads * dim * 2 * 2 / 1e6

    def written(bits) -> float:
        started = time.perf_counter()
        scales = KeyScales(QuantSpec(bits), [frames * tokens] * layers, heads, dim)
        for block in blocks:
            scales.feed(block)
        scales.finish()
        return time.perf_counter() - started

    rates = {}
    for bits in BITS:
        written(bits)  # warm
        best = min(written(bits) for _ in range(5))
        rates[bits] = {"seconds": best, "mb_per_s": kv_mb / best}
    return {"frames": frames, "tokens": tokens, "kv_mb": kv_mb, "by_bits": rates}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--ttft-frames", type=int, default=128)
    parser.add_argument("--ttft-layers", type=int, default=2)
    parser.add_argument("--clips", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2040)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="mmkv-quant-") as tmp:
        work = Path(tmp)
        write_dataset(work / "long", 1, max(args.frames, args.ttft_frames, 64), 5, kind="normal")
        video = work / "long" / "clips" / "clip_0000.mp4"
        write_dataset(work / "set", args.clips, 64, args.seed, kind="mixed")
        qa_file = work / "set" / "qa.jsonl"
        result = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "sizes": sizes(work, video, args.frames),
            "drift": drift(work, qa_file),
            "accuracy": accuracy(work, qa_file),
            "ttft": ttft(work, video, args.ttft_frames, args.ttft_layers),
            "host_quantize": host_quantize(),
            "synthetic_set": {"clips": args.clips, "frames": 64, "seed": args.seed},
        }
    print(json.dumps(result["drift"], indent=1))
    print(json.dumps(result["ttft"], indent=1))
    print(json.dumps(result["host_quantize"], indent=1))
    out = ROOT / "bench" / "results" / "quant.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
