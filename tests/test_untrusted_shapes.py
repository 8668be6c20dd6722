"""Issue 74, rows 7 and 9: a pack sealed as its forger made it, checksums and all. Its KV shape is
compared with the model before any block is read, and its positions with the header's range
wherever they are read."""

import pytest

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.options import AskOptions, GenerationOptions, Positions
from tests.conftest import SAMPLES
from tests.helpers import encode_pack
from tests.mutants import Parts, with_positions

QUESTION = "what color is the circle ?"


@pytest.fixture(scope="module")
def packs(tmp_path_factory, backbones):
    folder = tmp_path_factory.mktemp("shapes")
    made = {}
    for method in ("h2o", "streamingtom", "full"):
        made[method] = folder / f"{method}.kvpack"
        encode_pack(str(SAMPLES / "clip.mp4"), made[method], "demo", method)
    # M-RoPE: a video's time positions run past the text after it, so the bound is the header's
    made["qwen"] = folder / "qwen.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), made["qwen"], "tiny-qwen2-vl", "full")
    return made


def _ask(path, **options):
    from mmkv_cli import api

    asked = AskOptions(generation=GenerationOptions(max_new_tokens=2), **options)
    return api.PackSession(path, shared=True).ask(QUESTION, asked)


def test_a_per_head_pack_resealed_as_per_layer_does_not_fit_the_model(packs, tmp_path):
    def as_per_layer(header):
        kv = header["kv"]
        kv["layers"], kv["kv_heads"], kv["per_head"] = kv["layers"] * kv["kv_heads"], 1, False

    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(Parts.with_header(packs["h2o"], as_per_layer))
    with pytest.raises(PackError, match=r"the pack's KV \(8 x 1 x 32, .*\) does not fit the model "
                       r"\(4 x 2 x 32\)"):  # fmt: skip
        _ask(forged)


@pytest.mark.parametrize("method", ["full", "streamingtom", "qwen"])
@pytest.mark.parametrize("value", [-1_000_000, 2**31 - 1, "limit"])
@pytest.mark.parametrize("positions", [None, Positions.reindex])
def test_positions_outside_the_stream_are_refused_where_they_are_read(
    packs, tmp_path, method, value, positions
):
    from mmkv_cli.pack import PackReader

    layout = PackReader(packs[method]).header.layout
    assert layout.position_limit >= layout.next_position
    assert _ask(packs[method], positions=positions).answer  # the honest pack's are in range
    forged = tmp_path / "forged.kvpack"
    moved = layout.position_limit if value == "limit" else value
    forged.write_bytes(with_positions(packs[method].read_bytes(), moved))
    refused = r"corrupted \(a position of the blocks read outside -?\d+\.\."
    with pytest.raises(PackError, match=refused):
        _ask(forged, positions=positions)


def test_a_nan_scale_is_named_by_its_own_block(packs, tmp_path):
    """Row 8: a 4-bit pack with one value scale made NaN in its last block, every checksum made
    again: the refusal names that block, from a question's deferred verdict and from a gather."""
    import numpy as np

    from mmkv_cli.pack import PackReader
    from tests import mutants

    parts = Parts.of(packs["streamingtom"].read_bytes())
    table_entry = parts.directory["blocks.table"]
    table = np.frombuffer(
        mutants._tensor_bytes(parts, "blocks.table"), mutants.STORED[table_entry["dtype"]]
    ).reshape(table_entry["shape"])
    last, row = len(table) - 1, int(table[-1, 3])
    entry = parts.directory["blocks.vq"]
    start, stop = entry["data_offsets"]
    width = (stop - start) // entry["shape"][0]
    nan = mutants.NON_FINITE[entry["dtype"]][0]
    parts.data[start + row * width : start + row * width + len(nan)] = nan
    mutants._reseal_block(parts, parts.header(), "blocks.vq", row)
    parts.reseal()
    forged = tmp_path / "forged.kvpack"
    forged.write_bytes(parts.bytes())
    reader = PackReader(forged)
    names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
    culprit = reader.blocks.name(last)
    with pytest.raises(PackError, match=rf"NaN or Inf in the K/V of {culprit}\)"):
        reader.gather(names)
    with pytest.raises(PackError, match=rf"NaN or Inf in the K/V of {culprit}\)"):
        _ask(forged)
