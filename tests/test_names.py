"""Names from outside never become paths unchecked (issue 49): one check (mmkv_cli/core/names.py)
for stream names, pack names, batch outputs and eval run folders; every serve route and verb walked
with hostile names, and nothing created outside the packs folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.names import checked_name, inside, name_problem, stem_from
from mmkv_cli.core.options import EncodeOptions
from tests.abuse import HOSTILE, walk_serve_routes

PLAIN = ["clip", "clip-2.v1", "A_b", "x" * 128, "0"]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_is_refused_in_one_line(name):
    assert name_problem(name) is not None
    with pytest.raises(UsageError) as err:
        checked_name(name, "stream name")
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_name_passes(name):
    assert name_problem(name) is None


@pytest.mark.parametrize("name", HOSTILE + ["my video", "..mp4", "___", "\u00e9t\u00e9"])
def test_a_file_name_becomes_a_plain_stem(name):
    assert name_problem(stem_from(name)) is None


def test_a_name_that_is_a_link_out_of_the_folder_is_refused(tmp_path):
    folder, outside = tmp_path / "packs", tmp_path / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    (folder / "clip.kvpack").symlink_to(outside / "clip.kvpack")
    with pytest.raises(UsageError, match="leads out of"):
        inside(folder, "clip", ".kvpack")
    assert inside(folder, "other", ".kvpack") == folder / "other.kvpack"


def test_every_serve_route_refuses_hostile_names_and_writes_nothing(tmp_path):
    seen = walk_serve_routes(tmp_path)
    assert seen["created", 0] == 1, seen  # nothing appeared anywhere
    assert seen["POST /v1/streams", 400] == len(HOSTILE), seen
    statuses = {status for (route, status) in seen if route != "created"}
    assert statuses <= {400, 404}, seen


@pytest.mark.parametrize("media", ["../../x.mp4", "/tmp/.hidden.mp4", "a b\u00e9.mp4", "...mp4"])
def test_a_batch_pack_is_named_inside_its_folder_whatever_the_media_is_called(media):
    from mmkv_cli.backbones.spec import load_model_spec
    from mmkv_cli.batch.run import pack_name

    spec = load_model_spec("demo")
    name = pack_name(media, "0" * 64, {"family": "demo"}, EncodeOptions("full"), spec)
    assert name.endswith(".kvpack") and name_problem(name[: -len(".kvpack")]) is None


def test_an_eval_run_folder_stays_inside_its_output(tmp_path):
    from mmkv_cli.study.runs import run_folder

    for model in ("..", "../../up", "/models/x", "Qwen/Qwen2-VL-2B"):
        folder = run_folder(tmp_path, model, "full", "b0.5")
        assert folder.resolve().is_relative_to(tmp_path.resolve()), (model, folder)


def test_a_questions_file_with_a_byte_order_mark_keeps_its_ids_and_moments(tmp_path):
    from mmkv_cli.cli.questions import gather

    file = tmp_path / "q.jsonl"
    row = '{"id": "q1", "at": 1.5, "question": "what color is the circle ?"}'
    file.write_bytes(("\ufeff" + row + "\nwhich shape ?\n").encode())
    first, second = gather([], str(file))
    assert (first.id, first.at, first.text) == ("q1", 1.5, "what color is the circle ?")
    assert second.text == "which shape ?"


def test_a_manifest_with_a_byte_order_mark_reads_its_header(tmp_path):
    from mmkv_cli.batch.manifest import read_manifest

    clip = Path(__file__).resolve().parent.parent / "samples" / "clip.mp4"
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(f"\ufeffmedia,method\n{clip},hermes\n".encode())
    (item,) = read_manifest(str(manifest))
    assert item.options["method"] == "hermes"


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["ask", "x.kvpack", "-"], 2, "stdin is closed"),
        (["live", "-", "-o", "l.kvpack", "--model", "demo", "--questions", "q.txt"], 3, "closed"),
    ],
)
def test_a_closed_stdin_is_one_plain_line(tmp_path, args, code, says):
    import subprocess
    import sys

    main = (
        "import sys\nfrom mmkv_cli.cli.app import main\nsys.argv = ['mmkv', *sys.argv[1:]]\nmain()"
    )
    (tmp_path / "q.txt").write_text("")
    done = subprocess.run(
        [sys.executable, "-c", main, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: os.close(0),  # noqa: PLW1509 (the child starts with stdin closed)
        timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and says in lines[0], done.stderr
