"""`mmkv ls DIR` (and `inspect DIR`): one line a pack, what it holds and whether it is whole; a
damaged pack is named with its fault, never a traceback, and the listing goes on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmkv_cli import api
from mmkv_cli.cli.app import app
from mmkv_cli.core.errors import PackError
from tests.mutants import Parts

DATA = Path(__file__).parent / "data"


@pytest.fixture
def shelf(tmp_path):
    shutil.copy(DATA / "golden" / "full-llava.kvpack", tmp_path / "clip.kvpack")
    shutil.copy(DATA / "v6.kvpack", tmp_path / "old.kvpack")
    raw = (DATA / "golden" / "hermes-qwen25.kvpack").read_bytes()
    (tmp_path / "cut.kvpack").write_bytes(raw[: len(raw) // 2])  # truncated: refused on open
    parts = Parts.of(raw)
    start, _ = parts.directory["blocks.k"]["data_offsets"]
    parts.data[start + 3] ^= 0x20  # opens; verify names the block
    (tmp_path / "flipped.kvpack").write_bytes(parts.bytes())
    (tmp_path / "notes.txt").write_text("not a pack")
    return tmp_path


def test_a_listing_names_every_pack_and_its_state(shelf):
    rows = {row["name"]: row for row in api.listing(shelf)}
    assert sorted(rows) == ["clip.kvpack", "cut.kvpack", "flipped.kvpack", "old.kvpack"]
    assert rows["clip.kvpack"]["state"] == "opens" and rows["clip.kvpack"]["method"] == "full"
    assert rows["clip.kvpack"]["media"] == "clip.mp4" and rows["clip.kvpack"]["frames"] == 6
    assert rows["flipped.kvpack"]["state"] == "opens"
    cut = rows["cut.kvpack"]["state"]
    assert cut.startswith("cut.kvpack is corrupted") and str(shelf) not in cut
    checked = {row["name"]: row["state"] for row in api.listing(shelf, check=True)}
    assert checked["clip.kvpack"] == "verified" and checked["flipped.kvpack"] == "1 fault"
    assert checked["old.kvpack"] == "verified as far as v6 can tell"


def test_ls_and_inspect_of_a_folder_print_one_line_a_pack(shelf):
    shown = CliRunner().invoke(app, ["ls", str(shelf), "--verify"], env={"COLUMNS": "120"})
    assert shown.exit_code == 0, shown.output
    lines = [line for line in shown.output.splitlines() if ".kvpack" in line]
    assert len(lines) == 4 and "1 fault" in shown.output and "Traceback" not in shown.output
    listed = CliRunner().invoke(app, ["inspect", str(shelf), "--json"])
    assert [row["name"] for row in json.loads(listed.output)][0] == "clip.kvpack"
    empty = shelf / "empty"
    empty.mkdir()
    assert "no packs" in CliRunner().invoke(app, ["ls", str(empty)]).output
    with pytest.raises(PackError, match="not a folder"):
        api.listing(shelf / "clip.kvpack")


def test_a_listing_is_one_line_a_pack_at_80_columns(tmp_path, backbones):
    """Issue 75, row 6: `mmkv ls` of packs `mmkv batch` named (a content hash in each name) at 80
    columns: one line a pack, no word split."""
    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app
    from tests.conftest import SAMPLES
    from tests.helpers import encode_pack

    for name, method, extra in (
        ("clip-d56b59a537b2f53a", "recency", {"budget": 0.5}),
        ("clip-0f1e2d3c4b5a6978", "hermes", {"budget_tokens": 4096}),
    ):
        encode_pack(str(SAMPLES / "clip.mp4"), tmp_path / f"{name}.kvpack", "demo", method,
                    **extra)  # fmt: skip
    shown = CliRunner().invoke(app, ["ls", str(tmp_path)], terminal_width=80, env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    rows = lines[rule + 1 :]  # the title above may fold (a long folder); the rows may not
    assert len(rows) == 2 and all(".kvpack" in line for line in rows), shown.stdout
    assert "recency@0.5" in shown.stdout and "hermes@4096t" in shown.stdout
    assert all(line.rstrip().endswith("opens") for line in rows)
