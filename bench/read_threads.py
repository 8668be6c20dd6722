"""How a fresh read's speed depends on its threads, on this machine's cores:

    python bench/read_threads.py [--device cuda] [--quick]

The reading threads (tensors.READ_THREADS: a quarter of the cores, at most 4), the hashing threads
(hashing.HASH_THREADS: 8) and the group a GPU-bound read is staged in (staging.STAGE_BYTES: 64 MiB)
were set on a 2-core machine. Each setting is tried on four reads at 7B width, a fresh open each,
best of `--tries`:

- `gather`: every block of a 1.1 GB pack (100 frames of 196 tokens) onto the device;
- `hermes`: every block of a HERMES-shaped pack (512 frames of 8 tokens a layer, 236 MB);
- `layer_reads`: ReKV's reading inside the forward (28 layers in turn, k = 64 blocks each, a digest
  a layer), read as a question reads, each layer checked at once (`_at_once`), and with reads of
  8 MiB or more split over the reading threads (`_split`; tensors.PARALLEL_READ_BYTES, 32 MiB);
  HERMES's read as a question reads it too (`hermes_question_s`);
- `layer_picks`: StreamingTOM's 4-bit pack, 251 of 512 frames a layer (27 KB digest units), and
  read as a question reads it (`_question`: its checksums left to finish beside, 8 cores or more).

Writes bench/results/read-threads-<device>.json: seconds for each read and setting.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def use(read_threads: int, hash_threads: int, stage_bytes: int) -> None:
    """Every later read of this process with these settings (new pools; the old ones idle)."""
    from mmkv_cli.pack.integrity import hashing, tensors
    from mmkv_cli.pack.io import staging
    from mmkv_cli.pack.io.pools import KeptPool

    tensors.READ_THREADS, tensors._reading = read_threads, KeptPool(read_threads, "mmkv-read")
    hashing.HASH_THREADS, hashing._hashing = hash_threads, KeptPool(hash_threads, "mmkv-hash")
    staging.STAGE_BYTES = stage_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small packs, two settings")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from rates import gather_seconds, layer_picks, layer_reads, seven_b_pack

    from mmkv_cli.pack.integrity import hashing, tensors
    from mmkv_cli.pack.io import staging

    default = (tensors.READ_THREADS, hashing.HASH_THREADS, staging.STAGE_BYTES)
    frames, stom_frames = (8, 32) if args.quick else (100, 512)
    # 256 MiB too: the third H100 run found 64 MiB well ahead of 16 (docs/benchmarks.md)
    reads, hashes, stages = ([1, 4, 8], [4, 8, 15], [16 << 20, 64 << 20, 256 << 20])
    if args.quick:
        reads, hashes, stages = [1, 2], [2], [64 << 20]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        packs = {
            "gather": seven_b_pack(work / "a.kvpack", frames),
            "hermes": seven_b_pack(work / "h.kvpack", stom_frames, tokens=8),
        }
        keyed = seven_b_pack(work / "k.kvpack", frames, retrieval_keys=True)
        stom = seven_b_pack(work / "s.kvpack", stom_frames, True, tokens=50, bits=4)
        files = {"gather": "a", "hermes": "h"}
        for r, h, s in itertools.product(reads, hashes, stages):
            use(r, h, s)
            row = {"read_threads": r, "hash_threads": h, "stage_mib": s >> 20}
            for label, names in packs.items():
                path = work / f"{files[label]}.kvpack"
                row[f"{label}_s"] = gather_seconds(path, names, args.device, args.tries)
            if s == default[2]:  # the per-layer reads stage nothing: once a (read, hash) pair
                row["hermes_question_s"] = gather_seconds(
                    work / "h.kvpack", packs["hermes"], args.device, args.tries, question=True
                )
                picks, k = min(64, frames), work / "k.kvpack"  # ReKV's k
                row["layer_reads_s"] = layer_reads(k, keyed, args.device, picks, args.tries)
                row["layer_reads_at_once_s"] = layer_reads(
                    k, keyed, args.device, picks, args.tries, question=False
                )
                # a layer's 25 MB at 7B is under the parallel reads' 32 MiB: split it too
                parallel = tensors.PARALLEL_READ_BYTES
                tensors.PARALLEL_READ_BYTES = 8 << 20
                try:
                    row["layer_reads_split_s"] = layer_reads(
                        k, keyed, args.device, picks, args.tries
                    )
                finally:
                    tensors.PARALLEL_READ_BYTES = parallel
                half = len(stom) // 2 - 5
                for label, question in (("", False), ("_question", True)):
                    row[f"layer_picks{label}_s"] = layer_picks(
                        work / "s.kvpack", stom, args.device, half, args.tries, question
                    )
            print(json.dumps(row), flush=True)
            rows.append(row)
    use(*default)
    sizes = {"gather_frames": frames, "hermes_frames": stom_frames}
    result = {"device": args.device, "cpus": __import__("os").cpu_count(), **sizes, "rows": rows}
    out = Path(args.out) / f"read-threads-{'quick-' if args.quick else ''}{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)  # a sweep's figures are not lost to a name
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
