"""What `mmkv encode` tells its user off a terminal: the file and what it keeps, nothing before
them, and the frames it took when it took fewer than the media offers (said before the encode as
well as after: an hour thinned to 64 frames is not a surprise found in the answers)."""

from __future__ import annotations

from tests.conftest import ROOT
from tests.helpers import run_mmkv

CLIP = str(ROOT / "samples" / "clip.mp4")  # 8 s: 16 frames at the demo's 2 fps


def test_max_frames_thinning_is_said_before_and_after_the_encode(tmp_path):
    done = run_mmkv("encode", CLIP, "--model", "demo", "--max-frames", "4", "--no-server",
                    "-o", str(tmp_path / "t.kvpack"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    note = "4 of 16 frames, evenly spaced (--max-frames 4; --max-frames 0 takes all)"
    assert done.stderr.strip() == f"taking {note}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"wrote {tmp_path / 't.kvpack'} (")  # no blank line first
    assert lines[2] == f"took {note}"


def test_the_models_own_cap_is_named(tmp_path):
    out = tmp_path / "t.kvpack"
    done = run_mmkv("encode", CLIP, "--model", "demo", "--fps", "160", "-o", str(out),
                    "--no-server", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "taking 1024 of 1280 frames, evenly spaced (the model's 1024 at most;" in done.stderr
    assert '"frames_offered": 1280' in done.stdout and '"max_frames_by": "model"' in done.stdout


def test_an_encode_of_every_frame_says_nothing_of_frames(tmp_path):
    done = run_mmkv("encode", CLIP, "--model", "demo", "-o", str(tmp_path / "t.kvpack"),
                    "--no-server")  # fmt: skip
    assert done.returncode == 0 and done.stderr == ""
    assert len(done.stdout.splitlines()) == 2 and "frames" not in done.stdout


def test_a_warm_servers_encode_says_the_same(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "run"), "MMKV_KEEP_ALIVE": "1m"}
    (tmp_path / "run").mkdir()
    try:
        done = run_mmkv("encode", CLIP, "--model", "demo", "--max-frames", "4",
                        "-o", str(tmp_path / "t.kvpack"), env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "taking 4 of 16 frames" in done.stderr
        assert done.stdout.splitlines()[2].startswith("took 4 of 16 frames")
    finally:
        run_mmkv("stop", env=env)
