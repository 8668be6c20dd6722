"""Fuzz packs (issues 18, 40, 38): N seeded mutants of real packs, each asked from; counts per kind.

    python bench/fuzz.py [--mutants 10000] [--old 3000] [--rewrites 200] [--seed 2026]

Kinds (tests/mutants.py): data, header (a bit flipped), dtype (a directory dtype swapped for one of
the same size), truncate; and, re-sealed as a forger would (header checksum and index digest
recomputed), field (a header value replaced by junk), table (a table or time entry changed),
shape (a directory shape changed), nonfinite (a NaN or Inf written into K/V or a scale, every
checksum over it recomputed), and issue 74's: text (markup or escape codes in a header string;
the pack is then shown by inspect and ls, which must print it as it is), positions (every stored
position moved, in range or out), kvshape (the KV shape forged against the model).
Outcomes: refused (one clear error), same (the answer's logits
identical to the unmutated pack's), changed (different, and no error), nonfinite (an answer from
NaN/Inf logits), hang (over 60 s), internal (a crash). Goals: 0 internal, 0 hangs, 0 nonfinite,
and 0 changed among the kinds not re-sealed. Each mutant is asked twice: plainly and at second 2
(the block times' path).

Then: mutants of the older fixtures (tests/data/v3, v6, v7, v8q: no model, so every byte is read
back instead of asked); packs rewritten in place under an open session (`cp` over a served pack:
each question after it refused or answered from the bytes opened); and the read rate of a whole
pack at real width through the memory map the reader used before issue 40 and through pread, now.
Then the abuse of issue 49 (tests/abuse.py): every hostile name at every serve route and verb
(goal: 400 or 404, nothing created), and every way out of `mmkv live -` (goal: exit 0 with a pack
that verifies, or 3 with one line). Writes bench/results/fuzz.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
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
from mmkv_cli.core.errors import MmkvError  # noqa: E402
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions  # noqa: E402
from tests.abuse import STDIN_ENDINGS, end_live_from_stdin, walk_serve_routes  # noqa: E402
from tests.mutants import KINDS, mutate, read_everything, shown_raw  # noqa: E402

QUESTION = "which shape appeared first ?"
ASKS = [
    AskOptions(generation=GenerationOptions(max_new_tokens=1), keep_logits=True),
    AskOptions(at=2.0, generation=GenerationOptions(max_new_tokens=1), keep_logits=True),
]
SUBJECTS = [("full", 16), ("mukv", 4), ("hermes", 8), ("rekv", 2), ("recency", 1.5)]
OLD = ("3", "6", "7", "8q", "11")  # tests/data/v{name}.kvpack


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def bounded(work, seconds: int = 60) -> str:
    """work() -> an outcome, or "hang" past `seconds`, or "internal" on a crash."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        return work()
    except MmkvError:
        return "refused"
    except Hang:
        return "hang"
    except Exception as err:  # noqa: BLE001 (what the bench counts)
        return f"internal: {type(err).__name__}: {str(err)[:200]}"
    finally:
        signal.alarm(0)


def asked(path: Path, backbone, references) -> str:
    session = api.PackSession(path, backbone=backbone)
    logits = [session.ask(QUESTION, ask).first_logits for ask in ASKS]
    if not all(bool(torch.isfinite(x).all()) for x in logits):
        return "nonfinite"
    return "same" if all(torch.equal(a, b) for a, b in zip(logits, references)) else "changed"


def v8_mutants(args, backbone, rng, tmp: Path) -> tuple[dict, list]:
    subjects = []
    for method, bits in SUBJECTS:
        path = tmp / f"{method}-{bits}.kvpack"
        options = EncodeOptions(method, max_frames=16, kv_bits=bits, kv_group=8)
        api.encode(str(ROOT / "samples" / "clip.mp4"), path, options, backbone=backbone)
        session = api.PackSession(path, backbone=backbone)
        references = [session.ask(QUESTION, ask).first_logits for ask in ASKS]
        subjects.append((path, path.read_bytes(), references))
    counts, crashes = Counter(), []
    target = tmp / "mutant.kvpack"
    kinds = sorted(KINDS)
    for n in range(args.mutants):
        kind = kinds[n % len(kinds)]
        _, raw, references = subjects[n // len(kinds) % len(subjects)]
        target.write_bytes(mutate(raw, kind, rng))
        result = bounded(lambda refs=references: asked(target, backbone, refs))
        if kind in ("text", "field") and not result.startswith("internal"):
            shown = bounded(lambda: shown_raw(target) or "")  # inspect and ls print it as it is
            result = f"internal: {shown}" if shown and shown != "refused" else result
        if result.startswith("internal"):
            crashes.append(f"{n} {kind}: {result}")
        counts[kind, result.split(":")[0]] += 1
    return counts, crashes, subjects


def old_mutants(args, rng, tmp: Path) -> tuple[Counter, list]:
    fixtures = [(ROOT / "tests" / "data" / f"v{v}.kvpack").read_bytes() for v in OLD]
    counts, crashes = Counter(), []
    target = tmp / "old.kvpack"
    kinds = sorted(KINDS)
    for n in range(args.old):
        kind = kinds[n % len(kinds)]
        version = OLD[n // len(kinds) % len(OLD)]
        target.write_bytes(mutate(fixtures[OLD.index(version)], kind, rng))
        result = bounded(lambda: read_everything(target))
        if result.startswith("internal"):
            crashes.append(f"v{version} {n} {kind}: {result}")
        counts[f"v{version}", result.split(":")[0]] += 1
    return counts, crashes


def rewritten_under_reader(args, backbone, subjects, tmp: Path) -> Counter:
    """A session opened on one pack, the file then rewritten in place with another (or a mutant):
    the next question is refused or answered from the bytes first opened."""
    counts: Counter = Counter()
    served = tmp / "served.kvpack"
    rng = random.Random(args.seed + 1)
    for n in range(args.rewrites):
        source, _, references = subjects[n % len(subjects)]
        other = subjects[(n + 1) % len(subjects)][0]
        shutil.copyfile(source, served)
        session = api.PackSession(served, backbone=backbone)
        if rng.random() < 0.5:
            shutil.copyfile(other, served)  # truncates and rewrites, as cp does
        else:
            raw = bytearray(served.read_bytes())
            raw[rng.randrange(len(raw) // 2, len(raw))] ^= 0xFF
            with open(served, "r+b") as fh:  # one byte, in place: size kept
                fh.write(raw)
            stat = source.stat()
            os.utime(served, ns=(stat.st_atime_ns, stat.st_mtime_ns))

        def again(session=session, reference=references[0]):
            logits = session.ask(QUESTION, ASKS[0]).first_logits
            return "same" if torch.equal(logits, reference) else "changed"

        counts[bounded(again).split(":")[0]] += 1
    return counts


def read_rates(tmp: Path) -> dict:
    """A whole 450 MB pack at real width (28 layers, 4 KV heads x 128, fp16, 40 blocks of 196
    tokens) read block by block: the rows copied out of a memory map (the reader before issue 40)
    and through pread (now, with every check), best of 5."""
    import numpy as np
    from rates import best_rate, seven_b_pack

    from mmkv_cli.pack import PackReader

    path = tmp / "rate.kvpack"
    names = seven_b_pack(path, 40)
    size = path.stat().st_size
    reader = PackReader(path)
    reader.gather(names)
    entries = reader._tensors.entries  # noqa: SLF001 (the bench reads the old way by hand)
    start = reader._tensors.data_start  # noqa: SLF001
    mapped = np.memmap(path, dtype=np.uint8, mode="r")

    def by_map():
        for part in ("k", "v", "pos"):
            a, b = (start + o for o in entries[f"blocks.{part}"]["data_offsets"])
            count = entries[f"blocks.{part}"]["shape"][0]
            view = np.asarray(mapped[a:b]).reshape(count, -1)
            np.take(view, np.arange(count), axis=0)

    return {
        "pack_bytes": size,
        "memory_map_copy_gb_s": best_rate(size, by_map, 5),
        "pread_checked_blocks_gb_s": best_rate(size, lambda: reader.gather(names), 5),
        "pread_fresh_open_with_checksums_gb_s": best_rate(
            size, lambda: PackReader(path).gather(names), 5
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mutants", type=int, default=10000)
    parser.add_argument("--old", type=int, default=3000)
    parser.add_argument("--rewrites", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    backbone = load_backbone(LoadOptions("demo", "cpu"))
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmkv-fuzz-") as folder:
        tmp = Path(folder)
        counts, crashes, subjects = v8_mutants(args, backbone, rng, tmp)
        old, old_crashes = old_mutants(args, rng, tmp)
        rewrites = rewritten_under_reader(args, backbone, subjects, tmp)
        rates = read_rates(tmp)
        names = walk_serve_routes(tmp / "names")  # a fresh root: anything created is counted
        endings = {}
        for case, expected in STDIN_ENDINGS.items():
            (tmp / case).mkdir()
            code, lines, verified = end_live_from_stdin(case, tmp / case)
            lines = [line for line in lines if not line.startswith("ready: ")]  # not an ending
            clean = code == expected[-1] and len(lines) == 1 and verified in (True, None)
            endings[case] = {"exit": code, "lines": len(lines), "verified": verified, "ok": clean}
    kinds = sorted(KINDS)
    outcomes = ("refused", "same", "changed", "nonfinite", "hang", "internal")
    table = {kind: {r: counts[kind, r] for r in outcomes} for kind in kinds}
    old_table = {
        v: {r: old[v, r] for r in ("refused", "read", "hang", "internal")}
        for v in (f"v{name}" for name in OLD)
    }
    damaged = sum(counts[k, "changed"] for k in kinds if not KINDS[k])
    internal = sum(counts[k, "internal"] for k in kinds) + sum(
        old[v, "internal"] for v in old_table
    )
    hangs = sum(counts[k, "hang"] for k in kinds) + sum(old[v, "hang"] for v in old_table)
    nonfinite = sum(counts[k, "nonfinite"] for k in kinds)
    result = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "mutants": args.mutants,
        "old_format_mutants": args.old,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - started, 1),
        "by_kind": table,
        "old_formats": old_table,
        "rewritten_under_reader": dict(rewrites),
        "read_rate": rates,
        "resealed_kinds": [k for k in kinds if KINDS[k]],
        "internal_errors": internal,
        "hangs": hangs,
        "answers_from_nonfinite_logits": nonfinite,
        "silent_acceptances_of_damage": damaged + rewrites["changed"],
        "crashes": (crashes + old_crashes)[:50],
        "hostile_names": {f"{route} {status}": n for (route, status), n in sorted(names.items())},
        "live_stdin_endings": endings,
    }
    abused = sum(n for (route, status), n in names.items() if route != "created" and status >= 500)
    abused += sum(n for (route, count), n in names.items() if route == "created" and count)
    abused += sum(not e["ok"] for e in endings.values())
    print(f"{'kind':<10}{'resealed':>9}" + "".join(f"{r:>10}" for r in outcomes))
    for kind, row in table.items():
        print(
            f"{kind:<10}{'yes' if KINDS[kind] else 'no':>9}"
            + "".join(f"{row[r]:>10}" for r in outcomes)
        )
    for version, row in old_table.items():
        print(f"{version:<10}" + "".join(f"{k} {n:<8}" for k, n in row.items()))
    print(f"rewritten under an open session: {dict(rewrites)}")
    print(f"read rate: {rates}")
    print(f"hostile names: {result['hostile_names']}")
    print(f"live - endings: {endings}")
    print(
        f"internal errors: {internal}; hangs: {hangs}; answers from NaN/Inf: {nonfinite}; "
        f"damaged packs answering differently: {result['silent_acceptances_of_damage']}"
    )
    out = ROOT / "bench" / "results" / "fuzz.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if internal or hangs or nonfinite or result["silent_acceptances_of_damage"] or abused:
        sys.exit(1)


if __name__ == "__main__":
    main()
