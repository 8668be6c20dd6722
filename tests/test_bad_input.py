"""Bad input is one line and the right exit code, never a traceback, a hang or lost data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from mmkv_cli import api
from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.core.options import EncodeOptions
from mmkv_cli.media.stills import MAX_PAGE_PIXELS, page_scale
from mmkv_cli.pack.io.atomic import TEMP_SUFFIX, sweep_stale
from tests.conftest import SAMPLES
from tests.helpers import encode_pack


@pytest.fixture(scope="module")
def pack(clip, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "clip.kvpack"
    result = CliRunner().invoke(
        app, ["encode", clip, "-m", "demo", "--max-frames", "8", "-o", str(path)]
    )
    assert result.exit_code == 0, result.output
    return str(path)


def cases(pack, clip, tmp):
    (tmp / "afile").write_text("x")
    (tmp / "set.jsonl").write_text(
        json.dumps({"video": clip, "question": "q", "answer": "a", "timestamp": "soon"}) + "\n"
    )
    (tmp / "ok.jsonl").write_text(
        json.dumps({"video": clip, "question": "q", "answer": "a"}) + "\n"
    )
    os.mkfifo(tmp / "fifo.mp4")
    return [
        ("at negative", ["ask", pack, "what?", "--at", "-5"], 2, "--at must be"),
        ("at nan", ["ask", pack, "what?", "--at", "nan"], 2, "--at must be"),
        ("not UTF-8", ["ask", pack, "wh\udcffat?"], 2, "not valid UTF-8"),
        ("long question", ["ask", pack, "a " * 20000], 2, "longer than"),
        (
            "missing folder",
            ["encode", clip, "-m", "demo", "-o", str(tmp / "no" / "x.kvpack")],
            2,
            "does not exist",
        ),
        (
            "plot folder",
            ["profile", clip, "-m", "demo", "--plot", str(tmp / "no" / "p.png")],
            2,
            "its folder does not exist",
        ),
        ("synth fps 0", ["synth", str(tmp / "s"), "--fps", "0"], 2, "--fps"),
        ("synth into a file", ["synth", str(tmp / "afile")], 2, "is a file"),
        (
            "eval into a file",
            ["eval", str(tmp / "ok.jsonl"), "-m", "demo", "-o", str(tmp / "afile")],
            2,
            "is a file",
        ),
        (
            "eval moment",
            ["eval", str(tmp / "set.jsonl"), "-m", "demo", "-o", str(tmp / "e")],
            2,
            "not a number of seconds",
        ),
        (
            "fifo",
            ["encode", str(tmp / "fifo.mp4"), "-m", "demo", "-o", str(tmp / "f.kvpack")],
            3,
            "not a regular file",
        ),
        ("kv bits", ["convert", pack, str(tmp / "c.kvpack"), "--kv-bits", "5"], 2, "--kv-bits"),
    ]


def test_each_bad_input_is_one_line_and_its_exit_code(pack, clip, tmp_path):
    runner = CliRunner()
    for name, args, code, says in cases(pack, clip, tmp_path):
        result = runner.invoke(app, args)
        assert result.exit_code == code, (name, result.exit_code, result.output)
        assert says in result.output, (name, result.output)
        assert "Traceback" not in result.output and "internal error" not in result.output, name


def test_a_decompression_bomb_is_bad_media(tmp_path, monkeypatch):
    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 64 x 64 is over twice that
    result = CliRunner().invoke(
        app, ["encode", str(tmp_path / "big.png"), "-m", "demo", "-o", str(tmp_path / "b.kvpack")]
    )
    assert result.exit_code == 3 and "cannot read image" in result.output


def test_huge_pdf_pages_render_within_the_pixel_cap():
    scale = page_scale(14400, 14400, 1.0)  # an 801-byte PDF can declare this
    assert (14400 * scale) ** 2 <= MAX_PAGE_PIXELS * 1.001
    assert page_scale(612, 792, 1.0) == 1.0  # a letter page renders as asked


def test_an_output_that_is_the_input_by_any_name_is_refused(clip, tmp_path):
    video = tmp_path / "v.mp4"
    video.write_bytes(Path(clip).read_bytes())
    os.link(video, tmp_path / "hard.kvpack")
    (tmp_path / "soft.kvpack").symlink_to(video)
    runner = CliRunner()
    for name in ("hard.kvpack", "soft.kvpack"):
        out = tmp_path / name
        args = ["encode", str(video), "-m", "demo", "-o", str(out), "--force"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "is the media being encoded" in result.output
    assert video.read_bytes() == Path(clip).read_bytes()


def test_partial_packs_of_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    target = tmp_path / "x.kvpack"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **TEXT)
    stale = tmp_path / f".x.kvpack.{dead.stdout.strip()}{TEMP_SUFFIX}"
    live = tmp_path / f".x.kvpack.{os.getppid()}{TEMP_SUFFIX}"
    other = tmp_path / f".y.kvpack.{dead.stdout.strip()}{TEMP_SUFFIX}"
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    sweep_stale(target)
    assert not stale.exists() and live.exists() and other.exists()


TEXT = {"capture_output": True, "text": True, "check": True}


def test_eval_keeps_its_work_in_the_run_folder(clip, tmp_path, monkeypatch):
    import tempfile

    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(1) or real(*a, **k))
    (tmp_path / "q.jsonl").write_text(
        json.dumps({"video": clip, "question": "what color?", "answer": "red"}) + "\n"
    )
    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.study.evaluate import EvalSettings, evaluate

    settings = EvalSettings(max_frames=4, max_new_tokens=2)
    evaluate(
        str(tmp_path / "q.jsonl"),
        ["full"],
        [0.5],
        tmp_path / "out",
        settings,
        LoadOptions("demo", "cpu"),
    )
    assert not made  # nothing in the system's temp folder
    run = tmp_path / "out" / "demo" / "full-b1"
    assert (run / "predictions.jsonl").exists() and not (run / ".work").exists()


def test_a_pack_replaced_while_it_is_read_is_read_whole(pack, tmp_path, clip):
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    backbone = load_backbone(LoadOptions("demo", "cpu"))
    path = tmp_path / "p.kvpack"
    path.write_bytes(Path(pack).read_bytes())
    session = api.PackSession(path, backbone=backbone)
    before = session.ask("which shape appeared first ?").answer
    other = tmp_path / "other.kvpack"
    api.encode(clip, other, EncodeOptions("recency", 0.25, max_frames=8), backbone=backbone)
    os.replace(other, path)  # as encode --force does
    assert session.ask("which shape appeared first ?").answer == before


def test_a_full_disk_is_exit_4_with_the_reason_and_the_old_pack_intact(pack, clip, tmp_path):
    import errno

    path = tmp_path / "p.kvpack"
    path.write_bytes(Path(pack).read_bytes())
    before = path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    args = ["encode", clip, "-m", "demo", "--max-frames", "4", "-o", str(path), "--force"]
    real = os.fsync
    os.fsync = full
    try:
        result = CliRunner().invoke(app, args)
    finally:
        os.fsync = real
    assert result.exit_code == 4 and "No space left on device" in result.output
    assert path.read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TEMP_SUFFIX)]


def test_an_image_cut_short_mid_set_is_one_line_naming_it(tmp_path):
    """Images decode as the encode reads them: a file whose header is fine but whose data is cut
    short fails at its chunk, as exit 3 naming the file, and no pack is written."""
    folder = tmp_path / "shots"
    folder.mkdir()
    for i in range(12):
        Image.new("RGB", (32, 32), (20 * i, 0, 0)).save(folder / f"{i:02d}.png")
    data = (folder / "09.png").read_bytes()
    (folder / "09.png").write_bytes(data[: len(data) // 2])
    out = tmp_path / "s.kvpack"
    result = CliRunner().invoke(
        app, ["encode", str(folder), "-m", "demo", "--max-frames", "0", "-o", str(out)]
    )
    assert result.exit_code == 3, result.output
    assert f"cannot read image {folder / '09.png'}" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_a_question_too_long_or_a_seed_past_64_bits_is_one_clear_line_in_every_verb(
    tmp_path, backbones
):
    import pydantic

    from mmkv_cli.core.options import AskOptions, GenerationOptions
    from mmkv_cli.serve.requests import ChatRequest

    backbone = backbones["tiny-llava-ov"]
    pack = tmp_path / "p.kvpack"
    encode_pack(SAMPLES / "clip.mp4", pack, backbone=backbone, max_frames=2)
    session = api.PackSession(pack, backbone=backbone)  # what ask, chat, serve and live share
    with pytest.raises(UsageError, match="longer than 20000 characters"):
        session.ask("what ? " * 4000)
    sampled = AskOptions(generation=GenerationOptions(2, temperature=1.0, seed=2**70))
    with pytest.raises(UsageError, match="--seed must fit in 64 bits"):
        session.ask("what color ?", sampled)
    message = [{"role": "user", "content": "what color ?"}]
    with pytest.raises(pydantic.ValidationError):  # the server answers 400, not 500
        ChatRequest(model="p", messages=message, seed=2**70)
    assert session.ask("what color ?", AskOptions(generation=GenerationOptions(2))).token_ids


@pytest.mark.parametrize(
    "named, refusal",
    [
        (
            "rehearsal-qwen2.5-vl-7b",
            "holds KV of 4 layers x 2 heads x 32, and model .* makes",
        ),  # a 7B-wide model, never built
        ("someone/not-downloaded-model", "not on this machine: pass --model"),  # no download
    ],
)
def test_a_packs_model_name_is_checked_before_anything_is_built(pack, tmp_path, named, refusal):
    """Issue 40, item 10: the name a pack gives is its word only; its shapes and this machine's
    cache decide before a model is built or fetched."""
    import time

    from tests.mutants import Parts

    parts = Parts.of(Path(pack).read_bytes())
    header = parts.header()
    header["fingerprint"]["model"] = named
    parts.set_header(header)
    forged = tmp_path / "relabelled.kvpack"
    forged.write_bytes(parts.bytes())
    start = time.perf_counter()
    with pytest.raises(PackError, match=refusal):
        api.PackSession(forged)
    assert time.perf_counter() - start < 5  # building the 7B-wide model took 44 s


def test_numbers_and_nesting_past_any_sense_are_one_line_not_an_internal_error(tmp_path, pack):
    """Issue 40, item 12, and the /dev/zero row of item 11."""
    from mmkv_cli.batch.manifest import read_manifest
    from mmkv_cli.encode.checkpoint import META, _read
    from mmkv_cli.study.eval_sets.items import make_item
    from mmkv_cli.study.eval_sets.readers import load_items

    runner = CliRunner()
    for bad in ("nan", "-1", "inf"):
        result = runner.invoke(app, ["ask", pack, "q ?", "--temperature", bad])
        assert result.exit_code == 2 and "--temperature" in result.output, result.output
    with pytest.raises(UsageError, match="not a number of seconds"):
        make_item("v.mp4", "q ?", "a", at=10**400)
    deep = "[" * 100_000 + "]" * 100_000
    sets = tmp_path / "deep.jsonl"
    sets.write_text(deep + "\n")
    with pytest.raises(UsageError, match="nested too deep"):
        load_items(sets, task="mmkv", media=tmp_path)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(deep + "\n")
    with pytest.raises(UsageError, match="nested too deep"):
        read_manifest(str(manifest))
    manifest.write_text('{"media": "/dev/zero"}\n')
    with pytest.raises(UsageError, match="not a regular file"):
        read_manifest(str(manifest))
    junk = tmp_path / "piece.safetensors"
    from safetensors.torch import save_file

    save_file({"x": __import__("torch").zeros(1)}, str(junk), metadata={META: deep})
    with pytest.raises(PackError, match="not a readable checkpoint"):
        _read(junk)
