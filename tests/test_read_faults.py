"""Issue 74, rows 3 and 4: a file system that fails under a pack. A dangling link, a link loop, a
folder, a FIFO or a read that fails with EIO is one row of a listing, or one line and exit 4,
never exit 70 and never a lost listing; reads that fail at any call are one PackError."""

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from mmkv_cli import api
from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader
from mmkv_cli.pack.io import vectored
from tests.conftest import SAMPLES
from tests.helpers import encode_pack

runner = CliRunner()
EIO_FILE = "/proc/self/mem"  # a file whose every read fails with EIO (Linux)


@pytest.fixture(scope="module")
def good(tmp_path_factory, backbones):
    pack = tmp_path_factory.mktemp("good") / "good.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", "rekv")
    return pack


@pytest.fixture
def folder(tmp_path, good):
    (tmp_path / "good.kvpack").write_bytes(good.read_bytes())
    (tmp_path / "dangling.kvpack").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop.kvpack").symlink_to(tmp_path / "loop.kvpack")
    (tmp_path / "folder.kvpack").mkdir()
    os.mkfifo(tmp_path / "fifo.kvpack")
    if os.path.exists(EIO_FILE):
        (tmp_path / "eio.kvpack").symlink_to(EIO_FILE)
    return tmp_path


def test_a_listing_keeps_its_good_packs_and_says_each_fault(folder):
    for args in (["ls", str(folder)], ["ls", str(folder), "--verify"], ["inspect", str(folder)]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 0, (args, shown.output)
        assert "good.kvpack" in shown.stdout and "Traceback" not in shown.output
    rows = {
        r["name"]: r for r in json.loads(runner.invoke(app, ["ls", str(folder), "--json"]).stdout)
    }
    assert rows["good.kvpack"]["state"] == "opens"
    assert rows["dangling.kvpack"]["state"] == "cannot be read: No such file or directory"
    assert rows["loop.kvpack"]["state"].startswith("cannot be read: Too many levels")
    assert rows["folder.kvpack"]["state"] == "folder.kvpack is not a file"
    assert rows["fifo.kvpack"]["state"] == "fifo.kvpack is not a file"
    if "eio.kvpack" in rows:
        assert rows["eio.kvpack"]["state"] == "cannot read eio.kvpack: Input/output error"


@pytest.mark.skipif(not os.path.exists(EIO_FILE), reason="needs Linux's /proc/self/mem")
@pytest.mark.parametrize("command", [["verify"], ["inspect"], ["ask", "--no-server"]])
def test_a_pack_whose_reads_fail_is_one_line_and_exit_4(folder, command):
    pack = str(folder / "eio.kvpack")
    args = [*command, pack, *(["what ?"] if command[0] == "ask" else [])]
    done = runner.invoke(app, args)
    assert done.exit_code == 4, done.output
    assert done.stderr.strip() == f"error: cannot read {pack}: Input/output error"


def test_a_questions_line_naming_an_unreadable_pack_fails_alone(folder, tmp_path):
    lines = [{"question": "what color is the circle ?", "pack": str(folder / name)}
             for name in ("good.kvpack", "dangling.kvpack", "fifo.kvpack")]  # fmt: skip
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    done = runner.invoke(app, ["ask", "--questions", str(questions), "--json", "--no-server"])
    assert done.exit_code == 1, done.output  # some failed: not an internal error
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert "answer" in answers[0] and all("error" in a for a in answers[1:])


def _failing_at(monkeypatch, call: int, short: bool = False) -> dict:
    """os.pread, os.preadv and the vectored preadv fail with EIO (or read nothing: a file cut
    short) at their `call`-th call, counted together."""
    count = {"calls": 0}

    def wrap(real, nothing):
        def failing(*args):
            count["calls"] += 1
            if count["calls"] == call + 1:
                if short:
                    return nothing
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real(*args)

        return failing

    monkeypatch.setattr(os, "pread", wrap(os.pread, b""))
    monkeypatch.setattr(os, "preadv", wrap(os.preadv, 0))
    monkeypatch.setattr(vectored, "preadv", wrap(vectored.preadv, 0))
    return count


@pytest.mark.parametrize("short", [False, True])
def test_a_read_failing_at_any_call_is_one_pack_error(good, monkeypatch, short):
    """Open, a question's read of every block, and verify, with the reads failing at each call in
    turn until a run passes none: always a PackError, or the right result."""
    names = None
    for call in range(10_000):
        with monkeypatch.context() as patched:
            count = _failing_at(patched, call, short)
            try:
                reader = PackReader(good)
                names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
                reader.gather(names)
                api.verify(good)
            except PackError as err:
                said = str(err)
                assert "cannot read" in said or "changed while" in said or "truncated" in said
                assert "Input/output error" in said or short, said
                continue
        if count["calls"] <= call:  # no call failed: every read point was walked
            break
    assert names and call > 3


def test_a_write_failing_at_any_call_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The writer under a failing disk (EIO at each write, seek or fsync in turn, then at the
    rename): always `cannot write PATH: reason`, no pack at the path and no temporary beside it;
    the run past every call writes a pack that reads back."""
    import builtins

    from mmkv_cli.pack.access.writer import write_pack
    from mmkv_cli.pack.io.atomic import TEMP_SUFFIX
    from tests.helpers import pack_header
    from tests.scale_shapes import block, plain

    layers = 2
    header = pack_header(layers=layers, dtype="float16", heads=4, dim=128)
    spans = [block(f"b{i}", 3, i, layers) for i in range(3)]
    ends = plain("prefix", 2, layers), plain("suffix", 1, layers)
    path = tmp_path / "out" / "p.kvpack"
    path.parent.mkdir()
    real_open, real_fsync, real_replace = builtins.open, os.fsync, os.replace

    class Failing:
        """The file object `open` gave, failing at the `at`-th write, seek or flush."""

        def __init__(self, file, count, at):
            self.file, self.count, self.at = file, count, at

        def _step(self):
            self.count["calls"] += 1
            if self.count["calls"] == self.at + 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO))

        def write(self, data):
            self._step()
            return self.file.write(data)

        def seek(self, *args):
            self._step()
            return self.file.seek(*args)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

    for at in range(1000):
        count = {"calls": 0}

        def opening(name, mode="r", *args, at=at, count=count, **kwargs):
            file = real_open(name, mode, *args, **kwargs)
            writing = "w" in mode and str(name).endswith(TEMP_SUFFIX)
            return Failing(file, count, at) if writing else file

        def syncing(fd, at=at, count=count):
            count["calls"] += 1
            if count["calls"] == at + 1:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_fsync(fd)

        with monkeypatch.context() as patched:
            patched.setattr(builtins, "open", opening)
            patched.setattr(os, "fsync", syncing)
            try:
                write_pack(path, header, ends[0], spans, ends[1])
            except PackError as err:
                assert str(err) == f"cannot write {path}: Input/output error"
                assert sorted(os.listdir(path.parent)) == []  # nothing left, nothing half-written
                continue
        if count["calls"] <= at:  # no call failed: every write was walked
            break
    assert at > 5 and PackReader(path).gather(["b0", "b2"])[0][0].shape[1] == 6
    with monkeypatch.context() as patched:  # and the rename into place
        path.unlink()
        patched.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
        with pytest.raises(PackError, match="cannot write"):
            write_pack(path, header, ends[0], spans, ends[1])
        assert sorted(os.listdir(path.parent)) == []
    assert real_replace is os.replace


@pytest.mark.skipif(not os.path.exists(EIO_FILE), reason="needs Linux's /proc/self/mem")
def test_an_eval_set_whose_clip_cannot_be_read_is_one_line(tmp_path):
    """A clip of an eval set on a failing disk: one line naming it, the media's exit code."""
    from mmkv_cli.study.synth import write_dataset

    write_dataset(tmp_path / "set", clips=1, frames=8, seed=3)
    clip = next((tmp_path / "set" / "clips").glob("*.mp4"))
    clip.unlink()
    clip.symlink_to(EIO_FILE)
    args = ["eval", str(tmp_path / "set" / "qa.jsonl"), "--model", "demo", "--methods", "full",
            "-o", str(tmp_path / "out")]  # fmt: skip
    done = runner.invoke(app, args)
    assert done.exit_code == 3, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot read video {clip}")
