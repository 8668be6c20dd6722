"""The optional config file (TOML at $MMKV_CONFIG or ~/.config/mmkv/config.toml): defaults under
the command line and the environment, checked as a preset is, shown by `mmkv config`."""

import json
import os
import socket
import subprocess
import sys
import time
import tomllib

import httpx

from tests.conftest import SAMPLES
from tests.helpers import run_mmkv as mmkv_cli

CLIP = str(SAMPLES / "clip.mp4")


def settings(done) -> dict:
    assert done.returncode == 0, done.stderr
    return {row["key"]: (row["value"], row["from"]) for row in json.loads(done.stdout)["settings"]}


def test_without_a_file_every_setting_is_the_default_and_init_writes_one(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path), "MMKV_CONFIG": "", "MMKV_MODEL": ""}
    shown = mmkv_cli("config", "--json", env=env)
    assert json.loads(shown.stdout)["path"] == str(tmp_path / "mmkv" / "config.toml")
    values = settings(shown)
    assert values["model"] == ("llava-ov-0.5b", "default") and values["serve.port"][0] == 8000
    assert {source for _, source in values.values()} == {"default"}
    assert mmkv_cli("config", "--init", env=env).returncode == 0
    written = (tmp_path / "mmkv" / "config.toml").read_text()
    assert tomllib.loads(written) == {"serve": {}}  # every key there, commented out
    assert all(f"# {key.split('.')[-1]} = " in written for key in values)
    again = mmkv_cli("config", "--init", env=env)
    assert again.returncode == 6 and "already exists; pass --force" in again.stderr


def test_the_file_sets_defaults_under_the_command_line_and_the_environment(tmp_path):
    packs = tmp_path / "packs"
    packs.mkdir()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "mmkv.toml"
    config.write_text(
        f'model = "demo"\ndevice = "cpu"\npacks = "{packs}"\nlog_level = "info"\n'
        f'[serve]\nport = {port}\ncors = "*"\n'
    )
    env = {"MMKV_CONFIG": str(config), "MMKV_MODEL": "", "MMKV_LOG": ""}
    values = settings(mmkv_cli("config", "--json", env=env))
    assert values["model"] == ("demo", "config") and values["serve.cors"] == (["*"], "config")
    assert values["serve.host"] == ("127.0.0.1", "default") and values["dtype"][1] == "default"
    assert settings(mmkv_cli("config", "--json", env={**env, "MMKV_MODEL": "demo-grid"}))[
        "model"
    ] == ("demo-grid", "MMKV_MODEL")
    made = mmkv_cli("encode", CLIP, "-o", str(packs / "c.kvpack"), "--max-frames", "4", env=env)
    assert made.returncode == 0, made.stderr
    assert "loaded model demo (llava_onevision) on cpu" in made.stderr  # its model, its log level
    assert "c.kvpack" in mmkv_cli("ls", "--json", env=env).stdout  # its packs folder
    quiet = mmkv_cli("--log-level", "warning", "ask", str(packs / "c.kvpack"), "?", env=env)
    assert quiet.returncode == 0 and "INFO" not in quiet.stderr  # the command line wins
    script = f"import mmkv; print(mmkv.encode({CLIP!r}, 'p.kvpack', max_frames=2).model)"
    python = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, **env},
        timeout=300,
    )
    assert python.stdout.strip() == "demo", python.stderr  # Python's default model too
    server = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "serve"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, health = time.monotonic() + 60, None
        while health is None and time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
            except httpx.HTTPError:
                time.sleep(0.3)
        assert health and health["packs"] == 1  # its port, its packs folder
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_wrong_file_is_one_line_for_every_command(tmp_path):
    config = tmp_path / "mmkv.toml"
    cases = {
        'model = "demo"\nmodle = 1\n': "unknown key 'modle' (known: model, device,",
        "[serve]\nport = 99999\n": "serve.port: 99999 is above the maximum 65535",
        'log_level = "loud"\n': "log_level: 'loud' is not one of debug, info,",
        "model = \n": "not TOML",
        "x = " + "[" * 3000 + "]" * 3000 + "\n": "nested too deep",  # issue 74, row 5
        "# " + "x" * (1 << 20) + "\n": "too large for a config",  # row 11: refused unread
    }
    for text, said in cases.items():
        config.write_text(text)
        for command in (["methods"], ["config"]):
            done = mmkv_cli(*command, env={"MMKV_CONFIG": str(config)})
            assert done.returncode == 2 and done.stderr.startswith(f"error: {config}: "), text
            assert said in done.stderr and done.stderr.count("\n") == 1, done.stderr
    missing = mmkv_cli("methods", env={"MMKV_CONFIG": str(tmp_path / "none.toml")})
    assert missing.returncode == 2 and "which is not a file" in missing.stderr
    nobody = mmkv_cli("methods", env={"MMKV_CONFIG": "~nosuchuser/c.toml"})  # row 6
    assert nobody.returncode == 2 and "names no user here" in nobody.stderr
    assert nobody.stderr.count("\n") == 1, nobody.stderr


def test_the_guides_example_file_is_a_valid_config(tmp_path):
    from tests.conftest import ROOT

    text = (ROOT / "docs" / "config.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "c.toml"
    config.write_text(example)
    (tmp_path / "mmkv-presets").mkdir()  # the example's ~/mmkv-presets
    values = settings(
        mmkv_cli("config", "--json", env={"MMKV_CONFIG": str(config), "HOME": str(tmp_path)})
    )
    assert values["presets"] == (str(tmp_path / "mmkv-presets"), "config")
    assert values["serve.port"] == (8080, "config") and values["model"][1] == "config"
    assert {key for key, (_, source) in values.items() if source == "default"} == set()


def test_init_writes_example_values_that_are_settings_when_uncommented(tmp_path):
    """Issue 75, row 15: every key of `config --init`'s file has a value in TOML (in effect, or an
    example of its form), so a line uncommented is a setting; MMKV_CONFIG may name the file to
    make."""
    import re

    config = tmp_path / "new" / "mmkv.toml"
    made = mmkv_cli("config", "--init", env={"MMKV_CONFIG": str(config)})
    assert made.returncode == 0, made.stderr
    text = config.read_text()
    uncommented = re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", text)
    values = tomllib.loads(uncommented)
    assert values["model"] == "llava-ov-0.5b" and values["serve"]["port"] == 8000
    assert values["keep_alive"] == "5m" and values["serve"]["cors"] == ["http://localhost:3000"]
    keys = {line.split(" = ")[0].removeprefix("# ") for line in text.splitlines() if " = " in line}
    assert keys == {*values, *values["serve"]} - {"serve"}  # every key set, none left empty
