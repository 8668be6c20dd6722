"""Quantized encodes end to end, and `mmkv convert`: re-stored KV, refused precision raises, time
cuts, atomic and never over the source."""

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmkv_cli import api
from mmkv_cli.api import convert
from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import OutputExistsError, UsageError
from mmkv_cli.core.options import AskOptions, EncodeOptions
from mmkv_cli.pack import FORMAT_VERSION, PackReader
from mmkv_cli.pack.quantized.quant import QuantSpec

DATA = Path(__file__).parent / "data"
ASK = AskOptions(keep_logits=True)


@pytest.fixture(scope="module")
def packs(backbones, clip, tmp_path_factory):
    """tiny-qwen2-vl (M-RoPE) packs of the sample clip: as computed, and 4-bit from encode."""
    tmp = tmp_path_factory.mktemp("convert")
    backbone = backbones["tiny-qwen2-vl"]
    made = {}
    for bits in (16, 4):
        made[bits] = tmp / f"{bits}.kvpack"
        options = EncodeOptions("full", max_frames=8, kv_bits=bits, kv_group=16)
        api.encode(clip, made[bits], options, backbone=backbone)
    return backbone, made


def test_converting_to_4_bits_gives_the_pack_encode_would(packs, tmp_path):
    backbone, made = packs
    out = tmp_path / "c4.kvpack"
    info = convert(made[16], out, QuantSpec(4, 16))
    assert info["kv_bits"] == 4 and info["kv_group"] == 16 and info["bytes"] == out.stat().st_size
    shown = api.inspect(out)
    assert shown["kv_bits"] == 4 and shown["kv_group"] == 16
    assert shown["kv_bytes_per_token"] < 0.35 * shown["kv_bytes_per_token_as_computed"]
    direct, converted = PackReader(made[4]), PackReader(out)
    names = [direct.blocks.name(i) for i in range(len(direct.blocks))]
    for a, b in zip(direct.gather(names), converted.gather(names)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(direct.representatives(), converted.representatives())
    first = api.ask(made[4], "what color?", ASK, backbone=backbone).first_logits
    again = api.ask(out, "what color?", ASK, backbone=backbone).first_logits
    assert torch.equal(first, again)


def test_4_bit_answers_stay_close_to_the_computed_kv(packs):
    backbone, made = packs
    exact = api.ask(made[16], "what color?", ASK, backbone=backbone).first_logits
    rough = api.ask(made[4], "what color?", ASK, backbone=backbone).first_logits
    kl = torch.nn.functional.kl_div(
        rough.log_softmax(-1), exact.log_softmax(-1), log_target=True, reduction="sum"
    )
    assert 0 < float(kl) < 0.05  # changed, but little
    assert PackReader(made[4]).size < 0.5 * PackReader(made[16]).size


def test_re_storing_at_the_same_bits_changes_nothing(packs, tmp_path):
    _, made = packs
    out = tmp_path / "again.kvpack"
    convert(made[4], out, QuantSpec(4, 16))
    a, b = PackReader(made[4]), PackReader(out)
    assert a.stored_bytes(["blocks.k", "blocks.kq"]) == b.stored_bytes(["blocks.k", "blocks.kq"])
    names = [a.blocks.name(i) for i in range(len(a.blocks))]
    assert all(torch.equal(x, y) for x, y in zip(a.gather(names)[1], b.gather(names)[1]))


def test_raising_the_precision_is_refused_unless_forced(packs, tmp_path):
    _, made = packs
    with pytest.raises(UsageError, match="cannot bring back"):
        convert(made[4], tmp_path / "up.kvpack", QuantSpec(8, 16))
    convert(made[4], tmp_path / "up.kvpack", QuantSpec(16), force=True)
    reader = PackReader(tmp_path / "up.kvpack")
    assert reader.quant is None and reader._entries["blocks.k"]["dtype"] == "F32"


def test_a_time_cut_keeps_the_blocks_that_show_it(packs, tmp_path):
    backbone, made = packs
    source = PackReader(made[16])
    out = tmp_path / "cut.kvpack"
    convert(made[16], out, QuantSpec(16), start=1.0, stop=2.0)
    cut = PackReader(out)
    times = source.blocks.times()
    want = [i for i in range(len(times)) if times[i, 0] <= 2.0 and times[i, 1] >= 1.0]
    assert 0 < len(want) < len(times) and len(cut.blocks) == len(want)
    for new, old in enumerate(want):
        assert cut.blocks[new]["time"] == source.blocks[old]["time"]
        assert torch.equal(
            cut.span(cut.blocks.name(new)).keys[0], source.span(source.blocks.name(old)).keys[0]
        )
    assert cut.header.converted["range"] == [1.0, 2.0]
    assert api.ask(out, "what color?", backbone=backbone).answer is not None
    with pytest.raises(UsageError, match="no block"):
        convert(made[16], tmp_path / "none.kvpack", QuantSpec(16), start=500.0)


def test_convert_never_writes_over_its_source_or_an_existing_pack(packs, tmp_path):
    _, made = packs
    before = made[16].read_bytes()
    with pytest.raises(UsageError, match="being converted"):
        convert(made[16], made[16], QuantSpec(8), force=True)
    (tmp_path / "taken.kvpack").write_bytes(b"keep me")
    with pytest.raises(OutputExistsError):
        convert(made[16], tmp_path / "taken.kvpack", QuantSpec(8))
    assert made[16].read_bytes() == before
    assert (tmp_path / "taken.kvpack").read_bytes() == b"keep me"
    assert not list(tmp_path.glob(".*.mmkv-partial"))


def test_an_old_pack_converts_and_keeps_what_its_representatives_mean(tmp_path):
    out = tmp_path / "v3to8.kvpack"
    convert(DATA / "v3.kvpack", out, QuantSpec(8, 8))
    old, new = PackReader(DATA / "v3.kvpack"), PackReader(out)
    assert new.format_version == FORMAT_VERSION and new.rotated_representatives
    keys = new.gather(["b0", "b1"])[0]
    want = old.gather(["b0", "b1"])[0]
    for a, b in zip(keys, want):
        assert a.shape == b.shape and (a - b).abs().max() < 0.1  # 8-bit steps of a small range


def test_the_cli_converts_and_refuses_in_one_line(packs, tmp_path):
    _, made = packs
    runner = CliRunner()
    out = tmp_path / "cli.kvpack"
    done = runner.invoke(app, ["convert", str(made[16]), str(out), "--kv-bits", "2"])
    assert done.exit_code == 0 and out.exists(), done.output
    refused = runner.invoke(
        app, ["convert", str(out), str(tmp_path / "x.kvpack"), "--kv-bits", "8"]
    )
    assert refused.exit_code == 2 and "cannot bring back" in refused.output
    shown = runner.invoke(app, ["inspect", str(out)])
    assert "2-bit" in shown.output
    bad = runner.invoke(
        app, ["encode", "x.mp4", "-o", str(tmp_path / "y.kvpack"), "--kv-bits", "3"]
    )
    assert bad.exit_code == 2 and "--kv-bits must be one of" in bad.output


def test_a_cut_without_bits_keeps_the_source_storage(packs, tmp_path):
    """`mmkv convert movie.kvpack first-minute.kvpack --to 60` needs no --kv-bits: a 4-bit source
    gives a 4-bit cut with its own group, its stored codes untouched."""
    _, made = packs
    runner = CliRunner()
    out = tmp_path / "cut4.kvpack"
    done = runner.invoke(app, ["convert", str(made[4]), str(out), "--from", "1", "--to", "2"])
    assert done.exit_code == 0, done.output
    source, cut = PackReader(made[4]), PackReader(out)
    assert (cut.quant.bits, cut.quant.group) == (4, 16)
    first = int(source.blocks.times()[:, 1].searchsorted(1.0))  # the first block showing 1 s
    assert torch.equal(
        cut.gather([cut.blocks.name(0)])[0][0],
        source.gather([source.blocks.name(first)])[0][0],
    )
    alone = runner.invoke(
        app, ["convert", str(made[4]), str(tmp_path / "g.kvpack"), "--kv-group", "32"]
    )
    assert alone.exit_code == 2 and "pass --kv-bits too" in alone.output
    assert not (tmp_path / "g.kvpack").exists()


def test_convert_reads_each_block_once(packs, tmp_path, monkeypatch):
    """The table comes from the source's table, and each block is loaded once to be written: the
    writer used to load a block again for each of its stored tensors, for the table and for the
    representatives (8 times in all)."""
    from mmkv_cli.pack.access import convert as converting

    _, made = packs
    loads: list[int] = []
    getitem = converting._Blocks.__getitem__

    def counted(self, i):
        block = getitem(self, i)  # past the end raises, as a sequence's iteration expects
        loads.append(i)
        return block

    monkeypatch.setattr(converting._Blocks, "__getitem__", counted)
    info = convert(made[16], tmp_path / "c4.kvpack", QuantSpec(4, 16))
    assert info["blocks"] > 2
    assert sorted(set(loads)) == list(range(info["blocks"]))
    assert max(loads.count(i) for i in range(1, info["blocks"])) == 1  # block 0 gives the width
