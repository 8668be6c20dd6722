"""Moving code does not move bytes: tests/data/golden/*.kvpack were written by mmkv before the stage
packages (issue 35), and the same encodes today give the same header and the same tensors. A golden
pack is written again only where a method's output changed on purpose, said in its commit: MuKV's
budget bound (issue 39, mukv-qwen3), MEDA's pivot merge and per-head entropy (issue 38,
meda-llava-images), MuKV's code defaults (issue 38, mukv-qwen3), and all four for format v9 (issue
38: key groups spanning blocks; only mukv-qwen3, the quantized one, changed bytes), and all four for
format v10 (issue 48: BLAKE3 checksums; every tensor but the digests byte for byte as before), and
hermes-qwen25 for HERMES' layer-role pseudo-questions (issue 51: middle and deep layers keep other
tokens), and mukv-qwen3 for MuKV's dedup parameters (issue 51: three more fields in the header's
params, every tensor byte for byte as before), and hermes-qwen25 for HERMES' summary as an
ordinary cached token (issue 51: summaries held among the frames' tokens, so every block has a
retrieval key and the pack stores them), and all four for format v11 (issue 51: the version
number; every tensor byte for byte as before, meda-llava-images too, whose tiny model's heads all
keep the same tokens, so its pack stays per layer), with h2o-demo and meda-demo added: packs held
per head (the trained demo's heads keep different tokens), and all six for format v12 (issue 48: the
version number and `blocks.digest_layers`; every tensor byte for byte as before but the digests,
one a block as before, stored [blocks, 1, 32]), and hermes-qwen25 for HERMES' per-backbone curves
(issue 72: a Qwen backbone weighs recency as the authors' Qwen file does, so its middle layers
keep other tokens; `curves` in the header's params), and all six for `layout.position_limit` (issue
74: the bound every stored position is checked against; every tensor byte for byte as before), and
hermes-qwen25 for HERMES' per-layer continuation (issue 72: after a compression each layer's next
chunk follows its own furthest position, as the authors' code places it, so a layer whose summary
reaches further on M-RoPE's axes moves the others up; `continue_at` in the header's params, the
prefix's positions per layer)."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from tests.helpers import encode_pack

ROOT = Path(__file__).parent.parent
GOLDEN = Path(__file__).parent / "data" / "golden"
CASES = {
    "full-llava": dict(model="tiny-llava-ov", method="full", media="samples/clip.mp4"),
    "hermes-qwen25": dict(
        model="tiny-qwen2.5-vl", method="hermes", budget_tokens=24, media="samples/clip.mp4"
    ),
    "mukv-qwen3": dict(
        model="tiny-qwen3-vl", method="mukv", budget=0.5, media="samples/clip.mp4", kv_bits=4
    ),
    "h2o-demo": dict(model="demo", method="h2o", budget=0.25, media="samples/clip.mp4"),
    "meda-demo": dict(model="demo", method="meda", budget=0.25, media="samples/clip.mp4"),
    "meda-llava-images": dict(
        model="tiny-llava-ov", method="meda", budget=0.5, media="samples/images"
    ),
}
# what differs between two runs of one encode: when, and how long it took
VARYING = {"created", "stats"}


def without_digests(record):
    """The header less every span's checksum: a digest of bytes compared below within float
    tolerance (another CPU's kernels may round the last bit differently)."""
    if isinstance(record, dict):
        return {k: without_digests(v) for k, v in record.items() if k not in ("sha256", "blake3")}
    return record


def read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    with safe_open(str(path), "numpy") as f:
        header = json.loads(f.metadata()["mmkv"])
        return header, {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not iterable)


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_encode_writes_the_pack_it_wrote_before_the_move(tmp_path, monkeypatch, name):
    monkeypatch.chdir(ROOT)  # the media path is stored as given
    case = dict(CASES[name])
    out = tmp_path / f"{name}.kvpack"
    media, model = case.pop("media"), case.pop("model")
    encode_pack(media, out, model=model, fps=2.0, max_frames=6, **case)
    want_header, want = read(GOLDEN / f"{name}.kvpack")
    got_header, got = read(out)
    for key in VARYING:
        want_header.pop(key), got_header.pop(key)
    want_header.pop("integrity"), got_header.pop("integrity")  # digests of the compared bytes
    assert without_digests(got_header) == without_digests(want_header)
    assert sorted(got) == sorted(want)
    for tensor, expected in want.items():
        actual = got[tensor]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, tensor
        if tensor.endswith(("sha256", "blake3")):
            continue  # the checksums of the tensors compared here
        if expected.dtype.kind == "f":
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=tensor)
        else:
            assert np.array_equal(actual, expected), tensor
