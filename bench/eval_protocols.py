"""Both eval protocols side by side, for every method: replay (encode the whole clip, ask with --at)
against stream (answer each question when the stream reaches its moment, from the memory then).

    python bench/eval_protocols.py [--model demo] [--world demo] [--clips 8] [--frames 64]
        [--tokens 32] [--seed 2062]

A fixed memory of `--tokens` per layer for the methods that evict while streaming (a live stream has
no length to take a share of); MuKV at its own share (its views overlap); the methods that keep
everything once. Results: bench/results/eval_protocols-<world>.json, and a markdown table (per
question type, the moment questions among them) on stdout for docs/eval-demo.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mmkv_cli.core.options import LoadOptions
from mmkv_cli.methods import METHODS
from mmkv_cli.study.evaluate import EvalSettings, evaluate
from mmkv_cli.study.synth import write_dataset

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="demo")
    parser.add_argument("--world", default="demo")
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=2062)
    args = parser.parse_args()
    load = LoadOptions(args.model, "cpu")
    runs = []
    with tempfile.TemporaryDirectory(prefix="mmkv-protocols-") as work:
        data = Path(work) / "set"
        write_dataset(data, args.clips, args.frames, args.seed, world_name=args.world)
        qa = str(data / "qa.jsonl")
        fixed = sorted(n for n, m in METHODS.items() if m.blockwise is None and m.takes_budget)
        whole = sorted(n for n, m in METHODS.items() if not m.takes_budget)
        blockwise = sorted(n for n, m in METHODS.items() if m.blockwise is not None)
        for protocol in ("replay", "stream"):
            started = time.perf_counter()
            out = Path(work) / "out"
            settings = EvalSettings(max_new_tokens=4, protocol=protocol)
            tokens = EvalSettings(max_new_tokens=4, protocol=protocol, budget_tokens=(args.tokens,))
            done = evaluate(qa, whole, [], out, settings, load)["runs"]
            done += evaluate(qa, fixed, [], out, tokens, load)["runs"]
            done += evaluate(qa, blockwise, [0.5], out, settings, load)["runs"]
            print(f"{protocol}: {time.perf_counter() - started:.0f} s", flush=True)
            runs += done
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"eval_protocols-{args.world}.json"
    path.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    print(table(runs))
    print(f"wrote {path}")


def table(runs: list[dict]) -> str:
    types = list(dict.fromkeys(t for r in runs for t in r["by_type"]))
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lines = [
        "| method | budget | protocol | kept | all | " + " | ".join(types) + " |",
        "|---" * (5 + len(types)) + "|",
    ]
    for method in methods:
        for r in (r for r in runs if r["method"] == method):
            budget = (
                f"{r['budget_tokens']} tokens" if r.get("budget_tokens") else f"{r['budget']:g}"
            )
            cells = [
                f"{r['by_type'][t]['accuracy']:.2f}" if t in r["by_type"] else "-" for t in types
            ]
            kept = f"{r['kept']:.2f}" if r.get("kept") is not None else "-"
            lines.append(
                f"| {method} | {budget} | {r['protocol']} | {kept} | {r['accuracy']:.2f} | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
