"""mmkv batch: manifests checked before work, content-addressed packs, a ledger a rerun resumes
from, one bad video failing only its row; in-process, into S3 (moto), on a real local Ray."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mmkv_cli import api
from mmkv_cli.batch.driver import run_batch
from mmkv_cli.batch.manifest import read_manifest
from mmkv_cli.batch.run import BatchSettings
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import EncodeOptions, LoadOptions
from tests.conftest import ROOT, SAMPLES

DEMO = LoadOptions("demo", "cpu")


@pytest.fixture
def videos(tmp_path):
    """Two good clips (the sample under two names: two media) and one corrupt video."""
    folder = tmp_path / "videos"
    folder.mkdir()
    for name in ("a.mp4", "b.mp4"):
        shutil.copy(SAMPLES / "clip.mp4", folder / name)
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(4000))
    (folder / "notes.txt").write_text("not media")
    return folder


def mmkv(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
        timeout=timeout,
    )


def ledger(dest):
    return [json.loads(line) for line in (dest / "batch.jsonl").read_text().splitlines()]


def test_manifests_folder_glob_jsonl_csv(videos, tmp_path):
    assert [i.media for i in read_manifest(str(videos))] == [
        str(videos / n) for n in ("a.mp4", "b.mp4", "broken.mp4")
    ]
    assert len(read_manifest(str(videos / "[ab].mp4"))) == 2
    rows = tmp_path / "list.jsonl"
    rows.write_text(
        '{"media": "videos/a.mp4", "id": 7, "budget": 0.25}\n\n{"media": "videos/b.mp4"}\n'
    )
    first, second = read_manifest(str(rows))
    assert first.media == str(videos / "a.mp4") and first.id == "7"
    assert first.options == {"budget": 0.25} and second.options == {}
    table = tmp_path / "list.csv"
    table.write_text("media,method,max_frames\nvideos/a.mp4,recency,8\nvideos/b.mp4,,\n")
    first, second = read_manifest(str(table))
    assert first.options == {"method": "recency", "max_frames": 8} and second.options == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"media": "a.mp4", "budgt": 0.1}\n', "list.jsonl:1: unknown key 'budgt'"),
        ('{"media": "a.mp4"}\n{"media": "b.mp4", "max_frames": "8"}\n', "list.jsonl:2: max_frames"),
        ('{"media": "a.mp4"}\n{"media": "a.mp4"}\n', "list.jsonl:2: the same media"),
        ("[1, 2]\n", "list.jsonl:1: each line must be a JSON object"),
        ('{"id": 3}\n', "list.jsonl:1: media must be"),
    ],
)
def test_a_bad_manifest_row_is_refused_with_its_line(tmp_path, text, message):
    path = tmp_path / "list.jsonl"
    path.write_text(text)
    with pytest.raises(UsageError, match=message):
        read_manifest(str(path))


def test_a_bad_option_is_refused_before_any_model_loads(videos, tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text(f'{{"media": "{videos / "a.mp4"}", "method": "nosuch"}}\n')
    settings = BatchSettings(LoadOptions("no-such-model"), EncodeOptions(), str(tmp_path / "o"))
    with pytest.raises(UsageError, match="list.jsonl:1: unknown method 'nosuch'"):
        run_batch(read_manifest(str(path)), settings)
    assert not (tmp_path / "o").exists()
    path.write_text(f'{{"media": "{videos / "a.mp4"}"}}\n')
    onto_a_file = BatchSettings(DEMO, EncodeOptions(), str(path))
    with pytest.raises(UsageError, match="is a file"):
        run_batch(read_manifest(str(path)), onto_a_file)


def test_batch_in_process_resumes_and_names_packs_by_content(videos, tmp_path):
    dest = tmp_path / "packs"
    settings = BatchSettings(DEMO, EncodeOptions(method="mukv"), str(dest))
    rows = run_batch(read_manifest(str(videos)), settings)
    by_media = {os.path.basename(r["media"]): r for r in rows}
    assert [by_media[n]["status"] for n in ("a.mp4", "b.mp4", "broken.mp4")] == [
        "ok",
        "ok",
        "failed",
    ]
    assert "broken.mp4" in by_media["broken.mp4"]["error"]
    packs = sorted(p.name for p in dest.glob("*.kvpack"))
    assert len(packs) == 2 and all(p.startswith(("a-", "b-")) for p in packs)
    made = api.inspect(by_media["a.mp4"]["pack"])
    assert made["method"] == "mukv" and made["media"]["source"] == str(videos / "a.mp4")
    assert by_media["a.mp4"]["bytes"] == made["bytes"]
    # a rerun skips what is done, retries what failed; the ledger keeps both runs
    again = run_batch(read_manifest(str(videos)), settings)
    assert sorted(r["status"] for r in again) == ["failed", "skipped", "skipped"]
    assert len(ledger(dest)) == 6
    # other settings name other packs
    other = BatchSettings(DEMO, EncodeOptions(method="mukv", budget=0.25), str(dest))
    run_batch(read_manifest(str(videos / "a.mp4")), other)
    assert len(list(dest.glob("a-*.kvpack"))) == 2


def test_batch_into_s3_and_ask_from_there(s3_server, videos, tmp_path):
    rows_file = tmp_path / "list.jsonl"
    rows_file.write_text(
        f'{{"media": "{videos / "a.mp4"}", "id": "first"}}\n'
        f'{{"media": "{videos / "broken.mp4"}"}}\n'
    )
    settings = BatchSettings(DEMO, EncodeOptions(method="recency", budget=0.5), "s3://packs/run1")
    rows = run_batch(read_manifest(str(rows_file)), settings)
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert rows[0]["id"] == "first" and rows[0]["pack"].startswith("s3://packs/run1/a-")
    import s3fs

    fs = s3fs.S3FileSystem()
    stored = [json.loads(line) for line in fs.cat("packs/run1/batch.jsonl").decode().splitlines()]
    assert [r["status"] for r in stored] == ["ok", "failed"]
    answer = api.ask(rows[0]["pack"], "which shape appeared first ?", load=DEMO)
    assert answer.answer and answer.bytes_fetched > 0


def test_a_rerun_over_a_bucket_downloads_nothing_it_has_done(s3_server, tmp_path, monkeypatch):
    import s3fs

    from mmkv_cli.pack.io import storage

    fs = s3fs.S3FileSystem()
    for name in ("a.mp4", "b.mp4"):
        fs.put_file(str(SAMPLES / "clip.mp4"), f"packs/videos/{name}")
    settings = BatchSettings(DEMO, EncodeOptions(method="full"), str(tmp_path / "out"))
    items = read_manifest("s3://packs/videos/")
    assert [i.media for i in items] == ["s3://packs/videos/a.mp4", "s3://packs/videos/b.mp4"]
    assert [r["status"] for r in run_batch(items, settings)] == ["ok", "ok"]
    fetched = []
    real = storage.download
    monkeypatch.setattr(
        storage, "download", lambda url, into: fetched.append(url) or real(url, into)
    )
    assert [r["status"] for r in run_batch(items, settings)] == ["skipped", "skipped"]
    assert fetched == []  # the ledger's digests of unchanged objects were reused
    fs.pipe("packs/videos/b.mp4", (SAMPLES / "clip.mp4").read_bytes()[:-1000])  # b changes
    rows = run_batch(items, settings)
    assert fetched == ["s3://packs/videos/b.mp4"]
    assert rows[0]["status"] == "skipped" and rows[1]["status"] in ("ok", "failed")


def test_batch_on_a_local_ray_with_two_workers(videos, tmp_path):
    pytest.importorskip("ray")
    dest = tmp_path / "packs"
    done = mmkv(
        "batch", str(videos), "--out", str(dest), "--model", "demo", "--method", "mukv",
        "--ray", "local", "--workers", "2", "--json", timeout=600,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # the corrupt video fails its row, not the batch
    report = json.loads(done.stdout)
    assert (report["ok"], report["failed"], report["not_run"]) == (2, 1, 0)
    assert "1 of 3 items failed" in done.stderr.strip().splitlines()[-1]
    rows = ledger(dest)
    assert len({r["worker"] for r in rows}) == 2  # both actors took items
    local = tmp_path / "local"
    run_batch(
        read_manifest(str(videos)), BatchSettings(DEMO, EncodeOptions(method="mukv"), str(local))
    )
    assert sorted(p.name for p in dest.glob("*.kvpack")) == sorted(
        p.name for p in local.glob("*.kvpack")
    )  # the same names, whichever worker made them


def test_a_killed_batch_resumes_and_leaves_no_partial_pack(tmp_path):
    folder = tmp_path / "videos"
    folder.mkdir()
    for i in range(6):
        shutil.copy(SAMPLES / "clip.mp4", folder / f"c{i}.mp4")
    dest = tmp_path / "packs"
    args = [sys.executable, "-m", "mmkv_cli", "batch", str(folder), "--out", str(dest)]
    args += ["--model", "demo", "--method", "hermes"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (dest / "batch.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(ledger(dest))
    assert 1 <= done_before < 6
    finished = mmkv(
        "batch", str(folder), "--out", str(dest), "--model", "demo", "--method", "hermes"
    )
    assert finished.returncode == 0, finished.stderr
    rows = ledger(dest)[done_before:]
    assert sum(r["status"] == "skipped" for r in rows) >= done_before
    assert sorted(r["status"] for r in rows).count("failed") == 0
    packs = list(dest.glob("*.kvpack"))
    assert len(packs) == 6 and all(api.verify(p)["ok"] for p in packs)
    assert not [p for p in dest.iterdir() if p.name.endswith(".mmkv-partial")]


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux's /proc/self/mem")
def test_a_media_whose_reads_fail_fails_its_row_in_one_line(videos, tmp_path):
    """Issue 74: a dying disk under one media (EIO on read) is that row's one line."""
    (videos / "eio.mp4").symlink_to("/proc/self/mem")
    settings = BatchSettings(DEMO, EncodeOptions(method="recency", budget=0.5), str(tmp_path / "p"))
    rows = run_batch(read_manifest(str(videos / "eio.mp4")), settings)
    assert rows[0]["status"] == "failed"
    assert rows[0]["error"] == f"cannot read {videos / 'eio.mp4'}: Input/output error"
