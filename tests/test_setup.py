"""`make setup` (scripts/setup_venv.sh) on the machine it finds: the CPU-only torch taken by itself
where no GPU is and PyTorch's index answers, PyPI's wheel with a word where it does not, a changed
interpreter or choice rebuilding the venv, an unchanged one left alone, and its last line saying how
to run mmkv. The plan is read from a dry run (SETUP_DRY_RUN): nothing is installed here."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "setup_venv.sh"
TORCH = "torch==2.14.1 torchvision==0.29.1"
no_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine")


def setup(venv: Path, python: str = sys.executable, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": python, "VENV": str(venv), "TORCH": TORCH}
    full.update({"CPU": "", "TORCH_INDEX": "", "SETUP_DRY_RUN": "1", **env})
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60
    )


def built(venv: Path, line: str) -> None:
    """A venv that a setup of `line` made: its stamp, and an mmkv to run."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "mmkv").write_text("#!/bin/sh\n")
    (venv / "bin" / "mmkv").chmod(0o755)
    project = subprocess.run(["sha256sum", "pyproject.toml"], cwd=ROOT, capture_output=True)
    (venv / ".mmkv-setup").write_text(f"{line}\n{project.stdout.decode()[:16]}\n")


def this_python() -> str:
    return ".".join(str(part) for part in sys.version_info[:3])


@pytest.fixture
def cpu_index(tmp_path):
    """A stand-in for PyTorch's CPU index on loopback."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index")
    )
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@no_gpu
def test_without_a_gpu_the_cpu_torch_is_chosen_when_its_index_answers(tmp_path, cpu_index):
    done = setup(tmp_path / "venv", TORCH_CPU_INDEX=cpu_index)
    assert done.returncode == 0, done.stderr
    assert "no NVIDIA GPU here: the CPU-only torch" in done.stdout
    assert done.stdout.splitlines()[-1] == f"make setup: would install torch from {cpu_index}"


@no_gpu
def test_an_unreachable_cpu_index_falls_back_to_pypi_and_says_so(tmp_path):
    done = setup(tmp_path / "venv", TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")
    assert "cannot be reached: PyPI's torch" in done.stdout
    assert "TORCH_INDEX=URL names a mirror" in done.stdout
    assert done.stdout.splitlines()[-1] == "make setup: would install torch from PyPI"


def test_a_venv_built_as_asked_is_left_alone(tmp_path):
    venv = tmp_path / "venv"
    built(venv, f"python {this_python()}; torch {TORCH} from auto")
    done = setup(venv)
    assert done.returncode == 0
    assert done.stdout.strip() == f"make setup: {venv} is up to date (python {this_python()}; " + (
        f"torch {TORCH} from auto)"
    )


def test_a_changed_python_or_torch_choice_rebuilds_and_says_what_changed(tmp_path):
    venv = tmp_path / "venv"
    built(venv, f"python 3.99.0; torch {TORCH} from auto")
    done = setup(venv, CPU="0")
    assert done.returncode == 0
    assert (
        f"rebuilding {venv}: it was built with python 3.99.0; torch {TORCH} from auto; "
        f"now python {this_python()}; torch {TORCH} from pypi"
    ) in done.stdout
    assert done.stdout.splitlines()[-1] == "make setup: would install torch from PyPI"


def test_an_old_python_is_refused_in_one_line(tmp_path):
    old = tmp_path / "python3.10"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    done = setup(tmp_path / "venv", python=str(old))
    assert done.returncode == 2
    assert done.stdout.strip() == (
        f"make setup: mmkv needs Python 3.11 or newer; '{old}' is not "
        "(PYTHON=python3.13 picks another)"
    )


def test_setup_ends_by_saying_how_to_put_mmkv_on_the_path():
    last = SCRIPT.read_text().rstrip().splitlines()[-1]
    assert "source $VENV/bin/activate' puts mmkv on your PATH" in last


def test_the_venv_lets_type_checkers_see_mmkv(tmp_path):
    """`make setup`'s install is a path entry, not an import hook: mypy --strict finds mmkv's
    types from a folder of the user's own."""
    (tmp_path / "mine.py").write_text("import mmkv\n\nanswer: str = mmkv.ask('p', 'q').answer\n")
    found = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "mine.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert found.returncode == 0, found.stdout
