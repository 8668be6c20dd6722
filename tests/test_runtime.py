"""mmkv in a fresh process with nothing imported first, and the supported versions named in one
line (issue 47). Each run is its own interpreter: an import that only works after torch is
imported elsewhere (as LazyLoader's stand-in did on 3.12.3+) fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmkv_cli.core import runtime
from mmkv_cli.core.errors import SetupError
from mmkv_cli.core.lazy import Deferred
from tests.conftest import ROOT, SAMPLES

ENV_KEEP = {"HF_HUB_OFFLINE": "1"}


def fresh(code: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **ENV_KEEP},
        timeout=300,
    )


def test_the_facade_encodes_and_asks_with_nothing_imported_first(tmp_path):
    done = fresh(
        "import sys\n"
        "assert 'torch' not in sys.modules\n"
        "import mmkv\n"
        "assert 'torch' not in sys.modules, 'import mmkv loaded torch'\n"
        f"mmkv.encode({str(SAMPLES / 'clip.mp4')!r}, 'c.kvpack', model='demo', method='hermes')\n"
        "print(mmkv.ask('c.kvpack', 'what color is the circle ?').answer)\n"
        "print(mmkv.ask('c.kvpack', 'which shape appeared first ?').answer)\n",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "red"


def test_the_cli_encodes_and_asks_each_in_a_fresh_process(tmp_path):
    main = (
        "import sys\nfrom mmkv_cli.cli.app import main\nsys.argv = ['mmkv', *sys.argv[1:]]\nmain()"
    )
    clip = str(SAMPLES / "clip.mp4")
    done = fresh(main, "encode", clip, "--model", "demo", "-o", "c.kvpack", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    done = fresh(main, "ask", "c.kvpack", "what color is the circle ?", cwd=tmp_path)
    assert (done.returncode, done.stdout.strip()) == (0, "red"), done.stderr[-2000:]


def test_torch_imported_after_mmkv_is_the_whole_real_module():
    done = fresh(
        "import mmkv_cli.core.lazy, sys\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(torch.zeros(1).tolist(), hasattr(torch, 'Tensor'), mmkv_cli.core.lazy.torch.Tensor is torch.Tensor)"  # noqa: E501
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[0.0] True True"


def test_a_deferred_module_is_never_put_in_sys_modules():
    json_module = Deferred("json")
    assert not json_module.loaded and "not yet imported" in repr(json_module)
    assert json_module.dumps([1]) == "[1]"
    assert json_module.loaded and sys.modules["json"] is not json_module


@pytest.mark.parametrize(
    ("text", "release"),
    [("2.14.1+cpu", (2, 14, 1)), ("2.15.0.dev20261101", (2, 15, 0)), ("5.24.0rc1", (5, 24, 0))],
)
def test_release_reads_the_leading_digits(text, release):
    assert runtime.release(text) == release


def test_versions_outside_the_range_are_named_in_one_line():
    assert runtime.python_problem((3, 10, 13)) == (
        "mmkv needs Python 3.11 or newer; this is Python 3.10.13"
    )
    assert runtime.python_problem((3, 14, 7)) is None
    old = runtime.library_problem("torch", "2.4.1", runtime.TORCH_FLOOR)
    assert old.startswith("mmkv needs torch 2.6 or newer; this environment has torch 2.4.1")
    assert runtime.library_problem("torch", "2.6.0+cu124", runtime.TORCH_FLOOR) is None
    six = runtime.library_problem("transformers", "6.0.0", *runtime.TRANSFORMERS_RANGE)
    assert six.startswith("mmkv supports transformers below 6.0")
    assert "not installed" in runtime.library_problem("torch", None, runtime.TORCH_FLOOR)
    for line in (old, six):
        assert "\n" not in line


def test_an_old_torch_is_refused_before_a_model_loads(monkeypatch):
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    runtime.problem.cache_clear()
    monkeypatch.setattr(runtime, "installed_version", lambda name: "2.4.1")
    try:
        with pytest.raises(SetupError, match="needs torch 2.6 or newer") as err:
            load_backbone(LoadOptions(model="demo"))
        assert err.value.exit_code == 9
    finally:
        runtime.problem.cache_clear()


def test_the_cli_says_an_old_torch_in_one_line_and_exits_9(tmp_path):
    done = fresh(
        "import importlib.metadata as m, sys\n"
        "real = m.version\n"
        "m.version = lambda name: '2.4.1' if name == 'torch' else real(name)\n"
        "from mmkv_cli.cli.app import main\n"
        "sys.argv = ['mmkv', *sys.argv[1:]]\nmain()",
        "encode",
        str(SAMPLES / "clip.mp4"),
        "--model",
        "demo",
        "-o",
        "c.kvpack",
        cwd=tmp_path,
    )
    assert done.returncode == 9
    assert done.stderr.strip().splitlines() == [
        "error: mmkv needs torch 2.6 or newer; this environment has torch 2.4.1: "
        + runtime.HOW_TO_INSTALL
    ]
    assert not (tmp_path / "c.kvpack").exists()
