"""Real scale: rehearsal models (the real language-model shapes, random weights) over streams of
64 to 1800 frames (1800 = one hour at 0.5 fps), method against method.

    python bench/scale.py [--model rehearsal-llava-ov-0.5b] [--layers 1] [--frames 64,256,1024,1800]
        [--methods full,recency,hermes,mukv,rekv,snapkv] [--quadratic-tokens 60000] [--device auto]
        [--ask-as retrieve=two_pass] [--profile]

Every (method, frames) runs in its own process: peak RSS (and peak GPU memory) is per process. On a
CPU the real width runs at reduced depth (--layers); methods that attend over the whole stream at
encode (full, snapkv, h2o, pyramidkv, meda, aircache) run only up to --quadratic-tokens stream
tokens ("where it fits"). Figures, each a ratio within one run:
  P1  ask TTFT from the pack / re-prefilling the same stream and the question (full's prefill)
  P2  ask TTFT at the longest stream / at 256 frames
  P3  encode time / plain full prefill of the same stream
  pack bytes / physical bytes (tokens held x layers x 2 x KV heads x head dim x bytes per value)
--ask-as also times the same pack's questions under another reading of its method's parameters
(ReKV's two-pass retrieval against its in-forward one, say), in each row's `ask_as`. --profile
adds one more question under cProfile and torch's profiler: each row's `profile`, and one more
timed by thread (`read_split_ms`: seconds in preads and in checksums summed over every thread, the
asking thread's row reading, and its reading with the checksums' tail).
Writes bench/results/scale.json and scale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUADRATIC = {"full", "snapkv", "h2o", "pyramidkv", "meda", "aircache"}
QUESTION = "what happened first ?"

CHILD = r"""
import gc, json, resource, statistics, sys, time
import torch
from mmkv_cli import api
from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
from mmkv_cli.pack import PackReader
video, pack, model, layers, device, method, frames, question, ask_as, profiled = sys.argv[1:11]
backbone = load_backbone(LoadOptions(model, device, layers=int(layers) or None))
cuda = backbone.device.type == "cuda"
if cuda:
    torch.cuda.reset_peak_memory_stats()
options = EncodeOptions(method, fps=2.0, max_frames=int(frames), force=True)
info = api.encode(video, pack, options, backbone=backbone)
encode_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
gc.collect()  # the encode's objects are gone before asking, as in a later `mmkv ask`
one = AskOptions(generation=GenerationOptions(max_new_tokens=1))
api.ask(pack, question, one, backbone=backbone)  # warm: page cache, first-call allocations
asked = [api.ask(pack, question, one, backbone=backbone) for _ in range(7)]
ttft = statistics.median(a.ttft_s for a in asked)
# where the TTFT went, each phase's median: what grows with the stream shows here (P2)
phases = {k: statistics.median(a.phases_s[k] for a in asked) for k in asked[0].phases_s}

def timed(ask):
    ask()  # warm: page cache, first-call allocations
    asked = [ask() for _ in range(7)]
    phases = {k: statistics.median(a.phases_s[k] for a in asked) for k in asked[0].phases_s}
    return {"ttft_s": statistics.median(a.ttft_s for a in asked), "ttft_phases_s": phases}

readings = {}
if ask_as:  # the pack's parameters with some changed: the same blocks, another context policy
    import dataclasses
    from mmkv_cli.api import stored_method
    from mmkv_cli.ask.answer import answer_from_pack
    from mmkv_cli.core.spec import override
    change = dict(pair.split("=", 1) for pair in ask_as.split(","))
    held = PackReader(pack)
    chosen, params = stored_method(held)
    if chosen.context is not None and set(change) <= {f.name for f in dataclasses.fields(params)}:
        policy = chosen.context(override(params, change, "--ask-as"))
        readings[ask_as] = timed(lambda: answer_from_pack(backbone, held, policy, question, one))
profile = {}
if profiled == "1":  # one more question, under cProfile (host) and torch's profiler (kernels)
    from profiling import profiled
    profile.update(profiled(lambda: api.ask(pack, question, one, backbone=backbone), cuda))
    # and where one question's read went on every thread (cProfile sees only this one): seconds
    # in preads and in checksums summed over threads, and this thread's rows and checksum tail
    import threading
    from mmkv_cli.pack.access import block_store
    from mmkv_cli.pack.integrity import hashing
    from mmkv_cli.pack.access import reader as reader_module
    from mmkv_cli.pack.integrity import tensors
    spent, lock = {}, threading.Lock()

    kept = []

    def timing(owner, name, key):
        original = getattr(owner, name)
        kept.append((owner, name, original))
        def timed_call(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                with lock:
                    spent[key] = spent.get(key, 0.0) + time.perf_counter() - began
        setattr(owner, name, timed_call)

    timing(tensors.StoredTensors, "read_into", "preads_all_threads")  # one buffer each
    timing(tensors.StoredTensors, "_read_each", "table_preads_all_threads")  # runs' tables
    timing(hashing.BlockHashes, "_check", "checksums_all_threads")
    timing(block_store.BlockStore, "read_rows", "rows_this_thread")
    timing(reader_module, "hashed_beside", "rows_and_checksums")
    began = time.perf_counter()
    api.ask(pack, question, one, backbone=backbone)
    spent["ask"] = time.perf_counter() - began
    for owner, name, original in kept:
        setattr(owner, name, original)
    profile["read_split_ms"] = {k: round(1e3 * v, 2) for k, v in sorted(spent.items())}
reader = PackReader(pack)  # every block read and checksummed: the reader's rate from the page cache
names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
started = time.perf_counter()
for first in range(0, len(names), 256):
    reader.gather(names[first:first + 256])
read_gbps = reader.bytes_read / (time.perf_counter() - started) / 1e9
layers_kv = backbone.kv_shape()
per_value = {"float32": 4, "bfloat16": 2, "float16": 2}[layers_kv["dtype"]]
per_token = 2 * layers_kv["kv_heads"] * layers_kv["head_dim"] * per_value
held = sum(l["tokens_kept"] for l in info["layers"]) + info["prompt_tokens"] * len(info["layers"])
print(json.dumps({
    "method": method, "frames": int(frames), "tokens": info["visual_tokens_total"],
    "encode_s": info["encode_s"], "tokens_per_s": info["visual_tokens_total"] / info["encode_s"],
    "ttft_s": ttft, "ttft_phases_s": phases, "ask_as": readings,
    "bytes": info["bytes"], "physical_bytes": held * per_token,
    "kept": info["visual_kv_share"],
    "peak_rss": encode_peak_rss,
    "peak_gpu": torch.cuda.max_memory_allocated() if cuda else None,
    "read_gbps": read_gbps,
    "device": str(backbone.device), "dtype": layers_kv["dtype"], "layers": layers_kv["layers"],
    "profile": profile,
}))
"""


def run_one(video: Path, work: Path, args, method: str, frames: int) -> dict | None:
    pack = work / f"{method}-{frames}.kvpack"
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        str(video),
        str(pack),
        args.model,
        str(args.layers),
        args.device,
        method,
        str(frames),
        QUESTION,
        args.ask_as,
        "1" if args.profile else "0",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    pack.unlink(missing_ok=True)
    if done.returncode != 0:
        print(f"{method} {frames}: failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def figures(rows: list[dict], frames: list[int]) -> dict:
    by = {(r["method"], r["frames"]): r for r in rows}
    out: dict = {"P1": {}, "P2": {}, "P3": {}, "pack_over_physical": {}, "rss_over_64": {}}
    longest = max(frames)
    for r in rows:
        m, f = r["method"], r["frames"]
        full = by.get(("full", f))
        if full:  # re-prefilling = full's encode (the stream) plus its ask (the question)
            out["P1"].setdefault(m, {})[f] = r["ttft_s"] / (full["encode_s"] + full["ttft_s"])
            out["P3"].setdefault(m, {})[f] = r["encode_s"] / full["encode_s"]
        out["pack_over_physical"].setdefault(m, {})[f] = r["bytes"] / r["physical_bytes"]
        if (m, 256) in by and f == longest:
            out["P2"][m] = r["ttft_s"] / by[(m, 256)]["ttft_s"]
        if (m, 64) in by:
            out["rss_over_64"].setdefault(m, {})[f] = r["peak_rss"] / by[(m, 64)]["peak_rss"]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["frames"])
        x = [r["frames"] for r in mine]
        axes[0].plot(x, [r["tokens_per_s"] for r in mine], marker="o", label=method)
        axes[1].plot(x, [1000 * r["ttft_s"] for r in mine], marker="o", label=method)
        axes[2].plot(x, [r["peak_rss"] / 2**30 for r in mine], marker="o", label=method)
    for ax, title in zip(axes, ("encode tokens/s", "ask TTFT (ms)", "peak RSS (GiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("frames")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="rehearsal-llava-ov-0.5b")
    ap.add_argument("--layers", type=int, default=1, help="0: the model's full depth")
    ap.add_argument("--frames", default="64,256,1024,1800")
    ap.add_argument("--methods", default="full,recency,hermes,mukv,rekv,snapkv")
    ap.add_argument("--quadratic-tokens", type=int, default=60000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="scale.json", help="results file name inside --out")
    ap.add_argument(
        "--ask-as",
        default="",
        help="KEY=VALUE[,...]: also time the questions with the pack's parameters changed so",
    )
    ap.add_argument("--profile", action="store_true", help="profile one more question a row")
    args = ap.parse_args()
    frames = [int(f) for f in args.frames.split(",")]
    methods = args.methods.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmkv-scale-") as tmp:
        from mmkv_cli.study.synth import write_dataset

        write_dataset(Path(tmp) / "set", clips=1, frames=max(frames), seed=5, kind="normal")
        video = Path(tmp) / "set" / "clips" / "clip_0000.mp4"
        tokens_per_frame = 196  # both rehearsal families (Qwen: 196 per frame pair, half a frame)
        for f in frames:
            for method in methods:
                if method in QUADRATIC and f * tokens_per_frame > args.quadratic_tokens:
                    continue
                row = run_one(video, Path(tmp), args, method, f)
                if row:
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save(out / args.name, args, frames, rows)  # a cut-short run keeps its rows
    result = save(out / args.name, args, frames, rows)
    plot(rows, (out / args.name).with_suffix(".png"))
    print(json.dumps(result["figures"], indent=1))


def save(path: Path, args, frames: list[int], rows: list[dict]) -> dict:
    result = {
        "model": args.model,
        "layers": args.layers,
        "frames": frames,
        "rows": rows,
        "figures": figures(rows, frames),
    }
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
