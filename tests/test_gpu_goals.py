"""bench/gpu_goals.py: a device run's verdicts come from the parts it ran, never from a file an
earlier run left behind."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_goals", ROOT / "bench" / "gpu_goals.py")
gpu_goals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_goals)


def write(folder: Path, part: str, result: dict) -> None:
    (folder / f"gpu-{part}.json").write_text(json.dumps(result))


def scale_row(method: str, encode_s: float, ttft_s: float, **ask_as) -> dict:
    phases = {"select": 0.0, "read": ttft_s * 0.8, "prefill": ttft_s * 0.2}
    readings = {k: {"ttft_s": v, "ttft_phases_s": {}} for k, v in ask_as.items()}
    return {"method": method, "encode_s": encode_s, "ttft_s": ttft_s, "ttft_phases_s": phases,
            "ask_as": readings}  # fmt: skip


def verdicts(result: dict) -> dict[str, object]:
    return {row["goal"]: row["met"] for row in result["goals"]}


def test_goals_are_judged_from_the_parts_run_now(tmp_path):
    write(tmp_path, "floor", {"seconds": 10.0})
    write(tmp_path, "scale", {"rows": [
        scale_row("full", 14.0, 1.6),
        scale_row("hermes", 19.0, 0.11),
        scale_row("rekv", 12.0, 1.0, **{"retrieve=two_pass": 0.29}),
    ]})  # fmt: skip
    write(tmp_path, "read", {"fresh_gather_gb_s": 4.9, "fresh_gather_to_device_gb_s": 5.5,
                             "verify_gb_s": 14.0})  # fmt: skip
    write(tmp_path, "syncs", {"methods": {
        "hermes": {"per_chunk": 1.6, "per_chunk_growth": 1.0, "ask": 1},
        "rekv": {"per_chunk": 0.4, "ask": 29, "ask_as": "retrieve=two_pass", "ask_as_syncs": 2},
    }})  # fmt: skip
    write(tmp_path, "parity", {"rows": [{"equal": True}, {"equal": False}]})
    result = gpu_goals.summarize(tmp_path, ["floor", "scale", "read", "syncs"], {"read": 3.0})
    seen = verdicts(result)
    assert seen["encode full / bare chunked prefill"] is True  # 1.4
    assert seen["encode hermes / full"] is False  # 1.36
    assert seen["encode rekv / full"] is True
    assert seen["TTFT hermes (s)"] is True
    assert seen["TTFT rekv (s)"] is False and seen["TTFT rekv, retrieve=two_pass (s)"] is True
    assert seen["TTFT streamingtom (s)"] is None  # not in this run's scale
    assert seen["fresh gather to the host (GB/s)"] is False
    assert seen["fresh gather to the GPU (GB/s)"] is True
    assert seen["host syncs a chunk, hermes"] is True  # the chunk's own growth
    assert seen["host syncs a chunk, rekv (set-up and pack counted)"] is True
    assert seen["host syncs a question to its first token, rekv"] is False
    assert seen["host syncs a question to its first token, rekv, retrieve=two_pass"] is True
    # parity's file is there, but parity did not run now: its verdict is not taken from it
    assert seen["CUDA answers and kept tokens equal the CPU's"] is None
    flash = "an encode's causal chunk on flash attention = SDPA under its written-out mask"
    assert seen[flash] is None
    assert seen["--reduce dtd on the still clip / plain encode"] is None
    # a part that ran but wrote nothing this time: the file an earlier run left is not read
    later = gpu_goals.summarize(tmp_path, ["read"], since=time.time() + 60)
    assert verdicts(later)["fresh gather to the GPU (GB/s)"] is None
    result = gpu_goals.summarize(tmp_path, ["floor", "scale", "read", "syncs"], {"read": 3.0})
    saved = json.loads((tmp_path / "gpu-goals.json").read_text())
    assert saved == result and saved["part_seconds"] == {"read": 3.0}
    assert "NOT MET TTFT rekv (s): 1.0 (goal 0.3" in gpu_goals.table(result)


def test_the_causal_chunk_on_flash_is_met_only_where_flash_ran_and_agreed(tmp_path):
    flash = "an encode's causal chunk on flash attention = SDPA under its written-out mask"

    def judged(*shapes) -> bool | None:
        rows = [{"rows": r, "flash": f, "equal": e, "max_difference": 0.01,
                 "declared_s": 0.1, "written_out_s": 0.3} for r, f, e in shapes]  # fmt: skip
        causal = {"shapes": rows, "all_equal": all(s["equal"] for s in rows)}
        write(tmp_path, "parity", {"rows": [{"equal": True}], "causal_attention": causal})
        return verdicts(gpu_goals.summarize(tmp_path, ["parity"]))[flash]

    assert judged((3136, True, True), (40, True, True)) is True
    assert judged((3136, True, True), (40, True, False)) is False  # a difference past bf16's
    assert judged((3136, False, True), (40, True, True)) is False  # equal, but not on flash
    write(tmp_path, "parity", {"rows": [{"equal": True}]})  # a run from before the check
    assert verdicts(gpu_goals.summarize(tmp_path, ["parity"]))[flash] is None
