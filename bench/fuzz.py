"""Fuzz packs (issue 18): N seeded mutants of real packs, each asked from; counts per kind.

    python bench/fuzz.py [--mutants 10000] [--seed 2026]

Kinds (tests/mutants.py): data, header (a bit flipped), dtype (a directory dtype swapped for one of
the same size), truncate; and, re-sealed as a forger would (header checksum and index digest
recomputed), field (a header value replaced by junk), table (a table or time entry changed),
shape (a directory shape changed). Outcomes: refused (one clear error), same (the answer's logits
identical to the unmutated pack's), changed (different, and no error), internal (a crash). Goals: 0
internal, and 0 changed among the kinds not re-sealed. Each mutant is asked twice: plainly and at
second 2 (the block times' path). Writes bench/results/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mmkv_cli import api  # noqa: E402
from mmkv_cli.backbones.loading import load_backbone  # noqa: E402
from mmkv_cli.errors import MmkvError  # noqa: E402
from mmkv_cli.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions  # noqa: E402
from tests.mutants import KINDS, mutate  # noqa: E402

QUESTION = "which shape appeared first ?"
ASKS = [
    AskOptions(generation=GenerationOptions(max_new_tokens=1), keep_logits=True),
    AskOptions(at=2.0, generation=GenerationOptions(max_new_tokens=1), keep_logits=True),
]
SUBJECTS = [("full", 16), ("mukv", 4), ("hermes", 8), ("rekv-layers", 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutants", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    backbone = load_backbone(LoadOptions("demo", "cpu"))
    rng = random.Random(args.seed)
    counts: Counter = Counter()
    crashes = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmkv-fuzz-") as tmp:
        subjects = []
        for method, bits in SUBJECTS:
            path = Path(tmp) / f"{method}.kvpack"
            options = EncodeOptions(method, max_frames=16, kv_bits=bits, kv_group=8)
            api.encode(str(ROOT / "samples" / "clip.mp4"), path, options, backbone=backbone)
            session = api.PackSession(path, backbone=backbone)
            references = [session.ask(QUESTION, ask).first_logits for ask in ASKS]
            subjects.append((path.read_bytes(), references))
        target = Path(tmp) / "mutant.kvpack"
        kinds = sorted(KINDS)
        for n in range(args.mutants):
            kind = kinds[n % len(kinds)]
            raw, references = subjects[n // len(kinds) % len(subjects)]
            target.write_bytes(mutate(raw, kind, rng))
            try:
                session = api.PackSession(target, backbone=backbone)
                logits = [session.ask(QUESTION, ask).first_logits for ask in ASKS]
                same = all(torch.equal(a, b) for a, b in zip(logits, references))
                result = "same" if same else "changed"
            except MmkvError:
                result = "refused"
            except Exception as err:  # noqa: BLE001 (what the bench counts)
                result = "internal"
                crashes.append(f"{n} {kind}: {type(err).__name__}: {str(err)[:200]}")
            counts[kind, result] += 1
    table = {
        kind: {r: counts[kind, r] for r in ("refused", "same", "changed", "internal")}
        for kind in kinds
    }
    damaged = sum(counts[k, "changed"] for k in kinds if not KINDS[k])
    internal = sum(counts[k, "internal"] for k in kinds)
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "mutants": args.mutants,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - started, 1),
        "by_kind": table,
        "resealed_kinds": [k for k in kinds if KINDS[k]],
        "internal_errors": internal,
        "silent_acceptances_of_damage": damaged,
        "crashes": crashes[:50],
    }
    print(f"{'kind':<10}{'resealed':>9}{'refused':>9}{'same':>7}{'changed':>9}{'internal':>10}")
    for kind, row in table.items():
        print(
            f"{kind:<10}{'yes' if KINDS[kind] else 'no':>9}{row['refused']:>9}{row['same']:>7}"
            f"{row['changed']:>9}{row['internal']:>10}"
        )
    print(f"internal errors: {internal}; damaged packs answering differently: {damaged}")
    out = ROOT / "bench" / "results" / "fuzz.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if internal or damaged:
        sys.exit(1)


if __name__ == "__main__":
    main()
