"""`mmkv models` reads whole at 80 columns (issue 52): presets grouped by family, one line a
model, no name or hub id cut, and whether its weights are built in, on this machine, or on the
hub."""

from __future__ import annotations

import os
import subprocess
import sys

from mmkv_cli.backbones.spec import model_names


def test_models_at_80_columns_is_one_whole_line_a_model(tmp_path):
    (tmp_path / "ckpt").mkdir()  # a local folder (relative to where mmkv runs): weights here
    (tmp_path / "presets" / "models").mkdir(parents=True)
    (tmp_path / "presets" / "models" / "mine.yaml").write_text(
        "family: qwen2_vl\nsource: ckpt\ndescription: a fine-tune on this machine\n"
    )
    shown = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "--presets", str(tmp_path / "presets"), "models"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "80", "HF_HUB_OFFLINE": "1"},
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines) and "…" not in shown.stdout
    for name in [*model_names(), "mine"]:
        (row,) = [line.split() for line in lines if line.split()[:1] == [name]]
        assert row[-1] in ("hub", "here") or row[-2:] == ["built", "in"], row
    (mine,) = [line.split() for line in lines if line.startswith("mine ")]
    assert mine[1:] == ["ckpt", "here"]
    assert [line.split()[0] for line in lines if "hf/" in line or "Qwen/" in line]  # hub ids whole
    assert len(lines) < 45
