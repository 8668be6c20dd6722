"""Issue 48's GPU goals against what a `bench/gpu.py` run measured, as one table:

    python bench/gpu_goals.py [--out bench/results] [--parts parity,syncs,...]

bench/gpu.py calls it at the end of every run with the parts it ran, so a device session (15
minutes of device time, all tries together) reads its verdicts without working them out from six
files. Each goal comes from the files of the parts that measure it (bench/results/gpu-<part>.json);
a goal whose parts did not run in this invocation reads "not run", never a figure left there by
an earlier run. Writes gpu-goals.json beside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TTFT_GOALS_S = {"hermes": 0.12, "rekv": 0.3, "streamingtom": 0.2}
READ_GOAL_GB_S = 5.0
FULL_OVER_FLOOR = 1.5  # encode of `full` over the bare chunked prefill of the same tokens
STREAMING_OVER_FULL = 1.3  # every streaming method's encode over `full`'s
DTD_OVER_PLAIN = 0.35  # `--reduce dtd` on the still clip over a plain encode
SYNCS_A_CHUNK, SYNCS_A_QUESTION = 1.0, 2
PARTS = ("parity", "syncs", "floor", "read", "scale", "reduce")  # the parts the goals read


def goal(name: str, measured, target, met: bool | None, source: str, detail: str = "") -> dict:
    """One row: met None when the measurement is missing."""
    row = {"goal": name, "measured": measured, "target": target, "met": met, "from": source}
    return row | ({"detail": detail} if detail else {})


def load(out: Path, part: str, ran: set[str], since: float | None) -> dict | None:
    """Part `part`'s results, if it ran and wrote them (since: when the run began; a file older
    than that is an earlier run's, left where a part that failed wrote nothing)."""
    path = out / f"gpu-{part}.json"
    if part not in ran or not path.exists():
        return None
    if since is not None and path.stat().st_mtime < since:
        return None
    return json.loads(path.read_text())


def missing(name: str, target, parts: str) -> dict:
    return goal(name, None, target, None, f"not run ({parts})")


def parity_goals(parity: dict | None) -> list[dict]:
    flash = "an encode's causal chunk on flash attention = SDPA under its written-out mask"
    if parity is None:
        return [
            missing("CUDA answers and kept tokens equal the CPU's", "all", "parity"),
            missing(flash, "all", "parity"),
        ]
    rows = parity["rows"]
    equal = sum(r["equal"] for r in rows)
    out = [
        goal(
            "CUDA answers and kept tokens equal the CPU's",
            f"{equal} of {len(rows)}",
            "all",
            equal == len(rows),
            "gpu-parity.json",
        )
    ]
    causal = parity.get("causal_attention")
    if causal is None:  # a run from before the check
        return [*out, missing(flash, "all", "parity")]
    shapes = causal["shapes"]
    ran = all(s["flash"] for s in shapes)
    detail = "; ".join(
        f"{s['rows']} rows: {s['declared_s']} s against {s['written_out_s']} s, "
        f"largest difference {s['max_difference']:.4f}"
        for s in shapes
    )
    measured = f"{sum(s['equal'] for s in shapes)} of {len(shapes)} equal, flash {ran}"
    met = causal["all_equal"] and ran
    return [*out, goal(flash, measured, "all, on flash", met, "gpu-parity.json", detail)]


def encode_goals(scale: dict | None, floor: dict | None) -> list[dict]:
    rows = {r["method"]: r for r in (scale or {}).get("rows", [])}
    full = rows.get("full")
    out = []
    name = "encode full / bare chunked prefill"
    if full and floor:
        ratio = full["encode_s"] / floor["seconds"]
        out.append(goal(name, round(ratio, 3), FULL_OVER_FLOOR, ratio <= FULL_OVER_FLOOR,
                        "gpu-scale.json, gpu-floor.json"))  # fmt: skip
    else:
        out.append(missing(name, FULL_OVER_FLOOR, "scale with full, floor"))
    for method, row in rows.items():
        if method == "full":
            continue
        name = f"encode {method} / full"
        if full is None:
            out.append(missing(name, STREAMING_OVER_FULL, "scale with full"))
            continue
        ratio = row["encode_s"] / full["encode_s"]
        out.append(goal(name, round(ratio, 3), STREAMING_OVER_FULL,
                        ratio <= STREAMING_OVER_FULL, "gpu-scale.json"))  # fmt: skip
    return out


def ttft_goals(scale: dict | None) -> list[dict]:
    rows = {r["method"]: r for r in (scale or {}).get("rows", [])}
    out = []
    for method, target in TTFT_GOALS_S.items():
        row = rows.get(method)
        if row is None:
            out.append(missing(f"TTFT {method} (s)", target, f"scale with {method}"))
            continue
        readings = {"": row, **{f", {k}": v for k, v in row.get("ask_as", {}).items()}}
        for reading, asked in readings.items():
            seconds, phases = asked["ttft_s"], asked.get("ttft_phases_s", {})
            detail = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
            out.append(goal(f"TTFT {method}{reading} (s)", round(seconds, 4), target,
                            seconds <= target, "gpu-scale.json", detail))  # fmt: skip
    return out


def read_goals(read: dict | None) -> list[dict]:
    names = {
        "fresh_gather_gb_s": "fresh gather to the host (GB/s)",
        "fresh_gather_to_device_gb_s": "fresh gather to the GPU (GB/s)",
        "verify_gb_s": "verify (GB/s)",
    }
    if read is None:
        return [missing(name, READ_GOAL_GB_S, "read") for name in names.values()]
    return [
        goal(name, read[key], READ_GOAL_GB_S, read[key] >= READ_GOAL_GB_S, "gpu-read.json")
        for key, name in names.items()
    ]


def reduce_goals(reduce: dict | None) -> list[dict]:
    name = "--reduce dtd on the still clip / plain encode"
    rows = (reduce or {}).get("clips", {}).get("still", [])
    dtd = [r for r in rows if r["method"] == "full" and r["reduce"] == "dtd"]
    if not dtd:
        return [missing(name, DTD_OVER_PLAIN, "reduce")]
    ratio = dtd[0]["encode_over_prefill"]
    return [goal(name, round(ratio, 3), DTD_OVER_PLAIN, ratio <= DTD_OVER_PLAIN, "gpu-reduce.json")]


def sync_goals(syncs: dict | None) -> list[dict]:
    if syncs is None or "methods" not in syncs:
        return [missing("host syncs a chunk / a question", "1 / 2", "syncs on a GPU")]
    out = []
    for method, seen in syncs["methods"].items():
        # a chunk's own (growth over half the frames); runs before it: the encode's whole count
        growth = "per_chunk_growth" in seen
        a_chunk = seen["per_chunk_growth" if growth else "per_chunk"]
        name = f"host syncs a chunk, {method}" + ("" if growth else " (set-up and pack counted)")
        out.append(goal(name, a_chunk, SYNCS_A_CHUNK, a_chunk <= SYNCS_A_CHUNK, "gpu-syncs.json"))
        asked = seen["ask"]
        name = f"host syncs a question to its first token, {method}"
        out.append(goal(name, asked, SYNCS_A_QUESTION, asked <= SYNCS_A_QUESTION, "gpu-syncs.json"))
        if "ask_as_syncs" in seen:  # the same question read another way (ReKV's two-pass)
            asked = seen["ask_as_syncs"]
            name += f", {seen['ask_as']}"
            met = asked <= SYNCS_A_QUESTION
            out.append(goal(name, asked, SYNCS_A_QUESTION, met, "gpu-syncs.json"))
    return out


def summarize(
    out: Path,
    parts: list[str],
    part_seconds: dict | None = None,
    shape: dict | None = None,
    since: float | None = None,
) -> dict:
    """Every goal's row from the parts run now; written to out/gpu-goals.json and returned.
    shape: what the run measured (model, depth, frames, device): the goals are at 7B full depth,
    512 frames, on one H100, and a `--quick` run's verdicts say only that the script runs.
    since: when the run began (time.time()): files written before it are not this run's."""
    results = {part: load(out, part, set(parts), since) for part in PARTS}
    rows = [
        *parity_goals(results["parity"]),
        *encode_goals(results["scale"], results["floor"]),
        *ttft_goals(results["scale"]),
        *read_goals(results["read"]),
        *reduce_goals(results["reduce"]),
        *sync_goals(results["syncs"]),
    ]
    seconds = part_seconds or {}
    result = {"shape": shape or {}, "parts": parts, "part_seconds": seconds, "goals": rows}
    (out / "gpu-goals.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(result: dict) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in result.get("shape", {}).items())
    lines = [f"issue 48's goals ({shape or 'shape not given'}):"]
    for row in result["goals"]:
        verdict = {True: "met", False: "NOT MET", None: "-"}[row["met"]]
        measured = "" if row["measured"] is None else row["measured"]
        detail = f" [{row['detail']}]" if "detail" in row else ""
        lines.append(
            f"{verdict:7s} {row['goal']}: {measured} (goal {row['target']}; {row['from']}){detail}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    print(table(summarize(Path(args.out), args.parts.split(","))))


if __name__ == "__main__":
    main()
