"""3,000 seeded mutants of real packs, asked from: none may end in an internal error, and none whose
bytes were damaged (not re-sealed by a forger) may answer differently without saying so."""

import random
from collections import Counter

import pytest
import torch

from mmkv_cli import api
from mmkv_cli.core.errors import MmkvError
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions
from tests.mutants import KINDS, mutate, shown_raw

ASK = AskOptions(generation=GenerationOptions(max_new_tokens=1), keep_logits=True)
QUESTION = "which shape appeared first ?"


@pytest.fixture(scope="module")
def subjects(clip, tmp_path_factory):
    """The demo backbone and six packs of the sample clip: full as computed, mukv at 4 bits (its
    representatives, key and value scales and per-block tables), full at 1.5 bits (VidKV's codes
    and key-group planes), h2o at 4 bits (held per head: a layer of one head a KV head), rekv as
    computed and streamingtom at 4 bits (a retrieval key and a digest a block and layer, v12: each
    layer reads and checks its own blocks' rows, hashed on the bytes read)."""
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    backbone = load_backbone(LoadOptions("demo", "cpu"))
    tmp = tmp_path_factory.mktemp("fuzz")
    made = []
    subjects = [("full", 16), ("mukv", 4), ("full", 1.5), ("h2o", 4), ("rekv", 16)]
    for method, bits in [*subjects, ("streamingtom", 4)]:
        path = tmp / f"{method}-{bits}.kvpack"
        options = EncodeOptions(method, max_frames=8, kv_bits=bits, kv_group=8)
        api.encode(clip, path, options, backbone=backbone)
        reference = api.ask(path, QUESTION, ASK, backbone=backbone).first_logits
        made.append((path.read_bytes(), reference))
    return backbone, made


def outcome(raw: bytes, reference, backbone, path) -> str:
    path.write_bytes(raw)
    try:
        answer = api.PackSession(path, backbone=backbone).ask(QUESTION, ASK)
    except MmkvError:
        return "refused"
    except Exception as err:  # noqa: BLE001 (what the test is looking for)
        return f"internal: {type(err).__name__}: {err}"
    if not torch.isfinite(answer.first_logits).all():
        return "internal: an answer from non-finite logits"
    return "same" if torch.equal(answer.first_logits, reference) else "changed"


def test_mutated_packs_are_refused_or_answer_as_before(subjects, tmp_path):
    backbone, made = subjects
    rng = random.Random(2026)
    kinds = sorted(KINDS)
    seen, bad = Counter(), []
    for n in range(3000):
        kind = kinds[n % len(kinds)]
        raw, reference = made[n // len(kinds) % len(made)]
        result = outcome(mutate(raw, kind, rng), reference, backbone, tmp_path / "m.kvpack")
        if kind in ("text", "field") and not result.startswith("internal"):
            shown = shown_raw(tmp_path / "m.kvpack")  # inspect and ls print it as it is
            result = f"internal: {shown}" if shown else result
        seen[kind, result.split(":")[0]] += 1
        if result.startswith("internal") or (result == "changed" and not KINDS[kind]):
            bad.append((n, kind, result))
    assert not bad, bad[:10]
    # every kind of damage was caught somewhere, and most of it at once
    for kind in KINDS:
        assert seen[kind, "refused"] > 0, kind
    assert sum(v for (k, r), v in seen.items() if r == "refused") > 1500


@pytest.mark.parametrize("tensor", ["blocks.k", "blocks.kq", "prefix.v"])
def test_nan_or_inf_sealed_into_a_pack_is_refused_not_answered(subjects, tmp_path, tensor):
    """Issue 40, item 9: a forger re-seals every checksum over a NaN; the read refuses it."""
    from mmkv_cli.core.errors import PackError
    from tests import mutants

    backbone, made = subjects
    raw = made[1 if tensor == "blocks.kq" else 0][0]
    path = tmp_path / "nan.kvpack"
    path.write_bytes(mutants.nonfinite(mutants.Parts.of(raw), random.Random(7), tensor))
    faults = api.verify(path)["faults"]  # every checksum holds: only the values give it away
    assert len(faults) == 1 and "NaN or Inf" in faults[0] and "checksum" not in faults[0]
    try:
        answer = api.ask(path, QUESTION, ASK, backbone=backbone)
    except PackError as err:
        assert "NaN or Inf" in str(err)
    else:  # retrieval passed the forged block by: the answer is the pack's own
        assert tensor == "blocks.kq" and torch.equal(answer.first_logits, made[1][1])


def test_mutants_of_every_older_format_are_refused_or_read_whole(tmp_path):
    """Issue 40: v3, v6 and v7 packs get the same open-time checks as v8 where their bytes allow;
    a mutant of one never ends in an internal error or hands out NaN/Inf."""
    from pathlib import Path

    from tests.mutants import read_everything

    fixtures = [(Path(__file__).parent / "data" / f"v{v}.kvpack").read_bytes() for v in (3, 6, 7)]
    rng = random.Random(40)
    kinds, seen, bad = sorted(KINDS), Counter(), []
    path = tmp_path / "m.kvpack"
    for n in range(600):
        kind = kinds[n % len(kinds)]
        path.write_bytes(mutate(fixtures[n // len(kinds) % 3], kind, rng))
        result = read_everything(path)
        seen[kind, result.split(":")[0]] += 1
        if result.startswith("internal"):
            bad.append((n, kind, result))
    assert not bad, bad[:10]
    assert seen["nonfinite", "refused"] > 0 and seen["table", "refused"] > 0
