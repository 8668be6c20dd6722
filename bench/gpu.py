"""What only a GPU shows, in one run of under 8 minutes on one H100 (`make bench-gpu`):

    python bench/gpu.py [--device cuda] [--frames 512] [--quick]

1. parity: every method and reducer on the demo backbone, encoded and asked on the CPU and on the
   device: answers and kept tokens equal, and a device-made pack answered on the CPU.
2. syncs: one streaming encode per method at 7B width and full depth with
   `torch.cuda.set_sync_debug_mode("warn")`: the host syncs the device reports, per chunk.
3. floor: a bare chunked prefill of the language model over the same tokens (no mmkv around it).
4. read: a 7B-width pack (28 layers, 196 tokens a frame, fp16) read whole from the page cache by a
   fresh `gather` to the host and to the device, and by `verify` (goal: 5 GB/s), on this
   machine's cores; pinning a buffer and copying it to the device, pinned and pageable; ReKV's
   reading inside the forward (each layer its own k = 64 blocks) with a digest a block and a layer,
   read as a question reads it and each layer checked at once;
   StreamingTOM's 4-bit pack of 27 KB digest units, its question and `verify`, hashed on one
   thread and on the hashing threads.
5. scale, reduce and live: bench/scale.py, bench/reduce.py and bench/live.py at 7B full depth.
6. media: bench/media_prep.py, the host's decoding and RGB a frame of 1080p H.264 under FFmpeg's
   slice and frame threads, and the video processor on the host and on the device, as the
   encode's read-ahead runs them: the scale part's 128 px clips cost the host nothing, a user's
   video does.
7. early_write, only when `--parts` names it: bench/early_write.py (the pack written while full
   and rekv encode, against at the end). Three H100 runs settled that writing while encoding wins
   (docs/benchmarks.md), and its 78 s had put a whole run over 8 minutes.

Writes bench/results/gpu-<part>.json, and gpu-goals.json: issue 48's goals against this run's
figures, with each part's seconds (bench/gpu_goals.py; printed at the end). `--quick` runs every
part small, on any device (the CPU here): what CI-less sessions use to check that the script
itself runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
PARTS = ("parity", "syncs", "floor", "read", "scale", "reduce", "media", "early_write", "live")
DEFAULT_PARTS = tuple(part for part in PARTS if part != "early_write")  # a run of under 8 minutes
QUESTIONS = ["what color is the circle ?", "which shape appeared first ?"]
# the scripts import this checkout's mmkv_cli where it is not installed (a device machine), next
# to what PYTHONPATH already names (the wheels carried there)
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
}


def parity(device: str, work: Path, keys: int) -> dict:
    """Every method (and reducer on full) on the demo: the device's answers and kept tokens
    against the CPU's. The device's packs of full, rekv and streamingtom are written while they
    are encoded, however small; the CPU's at the end. The demo runs in float32, which flash
    attention does not take: its causal path is checked at 7B width in bfloat16 over `keys`
    (bench/attention_kernels.py)."""
    import attention_kernels

    import mmkv_cli.pack.access.early as early
    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
    from mmkv_cli.methods import METHODS
    from mmkv_cli.reduce import REDUCERS
    from tests.method_cases import case_for

    early.EARLY_BYTES = 0
    models = {d: load_backbone(LoadOptions("demo", d)) for d in ("cpu", device)}
    asking = AskOptions(generation=GenerationOptions(max_new_tokens=8))
    rows = [(m, None) for m in METHODS] + [("full", r) for r in REDUCERS]
    out = []
    for method, reduce in rows:
        seen = {}
        for where, backbone in models.items():
            pack = work / f"{method}-{reduce}-{where}.kvpack"
            options = EncodeOptions(method, force=True, reduce=reduce, **case_for(method).budget)
            info = api.encode(str(ROOT / "samples" / "clip.mp4"), pack, options, backbone=backbone)
            answers = [api.ask(pack, q, asking, backbone=backbone).answer for q in QUESTIONS]
            seen[where] = (answers, info["visual_tokens_kept"], pack)
        crossed = [  # the device's pack answered on the CPU
            api.ask(seen[device][2], q, asking, backbone=models["cpu"]).answer for q in QUESTIONS
        ]
        same = seen["cpu"][:2] == seen[device][:2] and crossed == seen["cpu"][0]
        out.append({"method": method, "reduce": reduce, "equal": same, "cpu": seen["cpu"][:2],
                    device: seen[device][:2], "device_pack_on_cpu": crossed})  # fmt: skip
        print(f"parity {method} {reduce or ''}: {'equal' if same else 'DIFFERENT'}", flush=True)
    causal = attention_kernels.check(device, keys)
    print(f"parity causal attention: {'equal' if causal['all_equal'] else 'DIFFERENT'}", flush=True)
    return {"device": device, "rows": out, "all_equal": all(r["equal"] for r in out),
            "causal_attention": causal}  # fmt: skip


def syncs(device: str, model: str, layers: int, frames: int, methods: list[str]) -> dict:
    """Host syncs the CUDA runtime reports during an encode, per chunk, and during a question
    that stops at its first token, each with where they were made (CPU: not measurable). A chunk's
    own: the growth from an encode of half the frames (tests/test_host_syncs.py counts so), so
    what an encode does once (the prompt, the pack) is not counted against a chunk, after a
    one-chunk encode uncounted (the half clip's count came out above the whole one's without)."""
    from mmkv_cli import api
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions
    from tests.method_cases import case_for

    if not device.startswith("cuda"):
        return {"device": device, "skipped": "host syncs are reported by CUDA only"}
    backbone = load_backbone(LoadOptions(model, device, layers=layers or None))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        video = make_video(Path(tmp), frames)
        for method in methods:
            pack = Path(tmp) / "p.kvpack"
            counts = {}
            # one chunk first, uncounted: what a process or a method does once (kernels loaded,
            # buffers grown) would otherwise fall in the half clip's count, not the whole one's
            warm = EncodeOptions(method, fps=2.0, max_frames=16, force=True,
                                 **case_for(method).budget)  # fmt: skip
            api.encode(str(video), pack, warm, backbone=backbone)
            for encoded in (frames // 2, frames):  # the whole clip last: its pack is asked
                options = EncodeOptions(method, fps=2.0, max_frames=encoded, force=True,
                                        **case_for(method).budget)  # fmt: skip
                with SyncLog() as log:
                    info = api.encode(str(video), pack, options, backbone=backbone)
                counts[encoded] = len(log.seen)
            first_token = AskOptions(generation=GenerationOptions(max_new_tokens=1))
            with SyncLog() as asked:
                api.ask(pack, QUESTIONS[0], first_token, backbone=backbone)
            other = reading_as(pack, backbone, first_token) if method == "rekv" else {}
            chunks = max(1, frames // 16)
            count = counts[frames]
            out[method] = {
                "syncs": count,
                "per_chunk": count / chunks,
                "per_chunk_growth": (count - counts[frames // 2]) / (chunks - chunks // 2),
                "encode_s": info["encode_s"],
                "where": log.places(),
                "ask": len(asked.seen),
                "ask_where": asked.places(),
                **other,
            }
            growth = out[method]["per_chunk_growth"]
            also = f", as {other['ask_as']} {other['ask_as_syncs']}" if other else ""
            print(f"syncs {method}: {count} ({growth:.2f} a chunk), ask {len(asked.seen)}{also}")
    return {"device": device, "model": model, "frames": frames, "methods": out}


def reading_as(pack: Path, backbone, first_token, change: str = "retrieve=two_pass") -> dict:
    """Host syncs of the same question read as `change` says (ReKV's two-pass retrieval: every
    layer's blocks chosen before the context is read, where its code chooses inside the forward,
    a wait a layer)."""
    from mmkv_cli.api import stored_method
    from mmkv_cli.ask.answer import answer_from_pack
    from mmkv_cli.core.spec import override
    from mmkv_cli.pack import PackReader

    reader = PackReader(pack)
    chosen, params = stored_method(reader)
    policy = chosen.context(override(params, dict([change.split("=", 1)]), "--ask-as"))
    with SyncLog() as asked:
        answer_from_pack(backbone, reader, policy, QUESTIONS[0], first_token)
    return {"ask_as": change, "ask_as_syncs": len(asked.seen), "ask_as_where": asked.places()}


class SyncLog:
    """The host syncs CUDA reports (`set_sync_debug_mode("warn")`) while open, each with its
    thread and the innermost frames of mmkv and of any library, so a count comes with places."""

    def __enter__(self) -> SyncLog:
        import torch

        self.seen: list[tuple[str, str, str]] = []
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._note
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode(0)
        self._warnings.__exit__(*exc)

    def _note(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack() if not f.filename.endswith("warnings.py")]
        ours = [f for f in stack if "/mmkv_cli/" in f.filename]
        mmkv = f"{ours[-1].filename.split('/mmkv_cli/')[-1]}:{ours[-1].lineno}" if ours else "-"
        where = stack[-2] if len(stack) > 1 else None  # [-1] is this method
        inner = f"{'/'.join(Path(where.filename).parts[-2:])}:{where.lineno}" if where else "-"
        self.seen.append((threading.current_thread().name, mmkv, inner))

    def places(self) -> list[dict]:
        counted = collections.Counter(self.seen).most_common(12)
        return [{"thread": t, "mmkv": m, "inner": i, "count": n} for (t, m, i), n in counted]


def floor(device: str, model: str, layers: int, frames: int) -> dict:
    """The language model alone over frames x 196 tokens, 16 frames a chunk, into one cache, on
    the attention kernels a loaded backbone runs (`cudnn_sdp`: whether cuDNN's was among them;
    `attention`: mmkv_unmasked where flash runs the model's heads and no causal mask is made)."""
    import torch

    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    backbone = load_backbone(LoadOptions(model, device, layers=layers or None))
    width = backbone.text_config.hidden_size
    chunk = 16 * 196
    cache = backbone.new_cache()
    embeds = torch.randn(1, chunk, width, device=backbone.device, dtype=backbone.dtype)
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, frames * 196, chunk):
            positions = torch.arange(first, first + chunk, device=backbone.device)[None]
            backbone.forward(embeds, positions.expand(backbone.position_dims, -1), cache)
    if backbone.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = frames * 196
    print(f"floor: {tokens} tokens in {seconds:.2f} s", flush=True)
    return {"device": device, "model": model, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "cudnn_sdp": torch.backends.cuda.cudnn_sdp_enabled(),
            "attention": backbone.text_config._attn_implementation}  # fmt: skip


def make_video(folder: Path, frames: int) -> Path:
    import av
    import numpy as np

    path = folder / "clip.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width = stream.height = 384
        for _ in range(frames):
            image = np.kron(rng.integers(0, 255, (12, 12, 3)), np.ones((32, 32, 1))).astype("uint8")
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def read_blocks(work: Path, blocks: int, device: str) -> dict:
    import read_part

    return read_part.read(work, blocks, device)


def bench(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=ENV)
    if done.returncode != 0:
        print(f"{script} exited {done.returncode}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="every part small: checks the script")
    ap.add_argument(
        "--out",
        help="where the results go (default: bench/results; with --quick, bench/results/quick,"
        " so a check of the script never replaces a device run's figures)",
    )
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS), help="which, in this order")
    ap.add_argument("--scale-methods", default="full,hermes,rekv,streamingtom")
    streaming = "full,hermes,rekv,streamingtom,infinipot,streammem"
    ap.add_argument("--sync-methods", default=streaming, help="the syncs part's methods")
    args = ap.parse_args()
    from gpu_goals import summarize, table

    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)} (known: {', '.join(PARTS)})")
    out = Path(args.out) if args.out else RESULTS / "quick" if args.quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    model, layers, frames = "rehearsal-llava-ov-7b", 0, args.frames
    if args.quick:
        model, layers, frames = "rehearsal-llava-ov-0.5b", 1, 32

    def save(part: str, result: dict) -> None:
        (out / f"gpu-{part}.json").write_text(json.dumps(result, indent=1) + "\n")

    common = ["--model", model, "--layers", str(layers), "--device", args.device]
    scale = ["--frames", str(frames), "--methods", args.scale_methods]
    scale += ["--out", str(out), "--ask-as", "retrieve=two_pass", "--name", "gpu-scale.json"]
    scale += ["--quadratic-tokens", str(frames * 196), "--profile"]  # full: its encode is a goal
    early = ["--frames", str(min(frames, 256)), "--repeats", "1"]
    early += ["--out", str(out / "gpu-early_write.json")]
    live = ["--model", model, "--minutes", "1", "--methods", "hermes,infinipot"]
    live += ["--tokens", "4096", "--device", args.device]
    media = ["--device", args.device, "--models", "rehearsal-llava-ov-0.5b"]
    media += ["--out", str(out / "gpu-media.json")]
    media += ["--sizes", "640x360" if args.quick else "1920x1080"]
    media += ["--seconds", "4" if args.quick else "20"]
    quick = 8 if args.quick else 100
    sync_methods = args.sync_methods.split(",")
    runs = {
        "parity": lambda: save(
            "parity", in_temp(lambda tmp: parity(args.device, tmp, frames * 196 // 4))
        ),
        "syncs": lambda: save(
            "syncs", syncs(args.device, model, layers, min(frames, 128), sync_methods)
        ),
        "floor": lambda: save("floor", floor(args.device, model, layers, frames)),
        "read": lambda: save("read", in_temp(lambda tmp: read_blocks(tmp, quick, args.device))),
        "scale": lambda: bench("scale.py", *common, *scale),  # ReKV's both readings, one pack
        "reduce": lambda: bench(
            "reduce.py",
            *common,
            "--frames",
            str(min(frames, 128)),
            "--out",
            str(out / "gpu-reduce.json"),
        ),
        "media": lambda: bench("media_prep.py", *media),
        "early_write": lambda: bench("early_write.py", *common, *early),
        "live": lambda: None if args.quick else bench("live.py", *live),
    }
    seconds, began = {}, time.time()
    for part in args.parts.split(","):
        started = time.perf_counter()
        runs[part]()
        seconds[part] = round(time.perf_counter() - started, 1)
        print(f"part {part}: {seconds[part]} s", flush=True)
    shape = {"model": model, "layers": layers or "all", "frames": frames, "device": args.device}
    print(table(summarize(out, args.parts.split(","), seconds, shape, began)), flush=True)


def in_temp(work):
    with tempfile.TemporaryDirectory() as tmp:
        return work(Path(tmp))


if __name__ == "__main__":
    main()
