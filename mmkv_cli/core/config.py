"""The optional config file: defaults for the model, device, dtype, packs folder, presets, log level
and the server, in TOML at $MMKV_CONFIG, else $XDG_CONFIG_HOME/mmkv/config.toml (~/.config/...).

A value given on the command line (or to a Python call) wins, then an environment variable that
names the same thing (MMKV_MODEL, MMKV_LOG, MMKV_PRESETS), then the file, then the default. The file
is checked as a preset is: an unknown key, a wrong type or a value out of range is one line naming
the file and the key. `mmkv config` shows every value and where it came from.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.spec import knob, override

_DURATION = re.compile(r"(\d+(?:\.\d*)?)\s*(ms|s|m|h|d)?")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
Level = Literal["debug", "info", "warning", "error", "critical"]


@dataclass(frozen=True)
class ServeConfig:
    """`mmkv serve`'s options, by their names (None: the option's own default)."""

    host: str | None = knob(None, "address to bind (loopback unless you open it)")
    port: int | None = knob(None, "TCP port", low=0, high=65535)
    queue: int | None = knob(None, "requests that may wait; more get 503", low=1)
    models: int | None = knob(None, "backbones kept loaded (LRU)", low=1)
    cors: tuple[str, ...] | None = knob(None, "origins whose web pages may call the API ('*': any)")
    preload: bool | None = knob(None, "load the model before answering anything, /health included")
    open_metrics: bool | None = knob(None, "answer /metrics without the API key (for a scraper)")
    cache_gb: float | None = knob(
        None, "GiB of hot packs' KV a server keeps in memory (default: a quarter of RAM)", above=0
    )


@dataclass(frozen=True)
class Config:
    """What the file may set; None: not set (the built-in default stands)."""

    model: str | None = knob(None, "the model encode, live, eval and batch load unless told")
    device: str | None = knob(None, "where models run unless told: auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = knob(
        None, "the weights' dtype unless told"
    )
    packs: str | None = knob(None, "the folder `serve` serves and `ls` lists when none is given")
    presets: str | None = knob(None, "a folder of your presets (methods/, models/), as --presets")
    log_level: Level | None = knob(None, "log records from this level (as --log-level)")
    serve: ServeConfig = knob(ServeConfig(), "`mmkv serve`'s settings")
    keep_alive: str | None = knob(
        None,
        "when set (300, '5m', '1h'; -1: forever), ask, chat and encode start a warm local server "
        "if none runs, which leaves after that long idle",
    )
    host: str | None = knob(None, "the warm server's socket the CLI uses (as MMKV_HOST)")


def config_path() -> Path:
    """Where the config file is read from (it need not exist)."""
    if os.environ.get("MMKV_CONFIG"):
        named = os.environ["MMKV_CONFIG"]
        try:
            return Path(named).expanduser()
        except RuntimeError:  # ~user of no such user
            raise UsageError(f"MMKV_CONFIG names {named}, whose ~ names no user here") from None
    home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(home) / "mmkv" / "config.toml"


@functools.cache
def config() -> Config:
    """The config file's values over the defaults, read and checked once a process. A file named by
    $MMKV_CONFIG must exist; the default one may not."""
    path, data = config_path(), _written()
    if data is None:
        return Config()
    keep = data.get("keep_alive")
    if isinstance(keep, int | float) and not isinstance(keep, bool):  # seconds, as a number
        data = {**data, "keep_alive": str(keep)}
    if isinstance(data.get("serve"), dict) and isinstance(data["serve"].get("cors"), str):
        data = {**data, "serve": {**data["serve"], "cors": [data["serve"]["cors"]]}}  # one origin
    try:
        chosen = override(Config(), data, "config")
    except UsageError as err:
        said = str(err).removeprefix("config.").removeprefix("config: ")
        raise UsageError(f"{path}: {said}") from None
    if chosen.keep_alive is not None:
        try:
            seconds_of(chosen.keep_alive, "keep_alive")
        except UsageError as err:
            raise UsageError(f"{path}: {err}") from None
    for key in ("packs", "presets"):  # folders: ~ is the user's home, as in a shell
        folder = getattr(chosen, key)
        if folder is not None and "://" not in folder:
            chosen = replace(chosen, **{key: os.path.expanduser(folder)})
    if chosen.presets is not None and not Path(chosen.presets).is_dir():
        raise UsageError(f"{path}: presets: no such folder {chosen.presets}")
    return chosen


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; a larger file is refused unread


@functools.cache
def _written() -> dict[str, Any] | None:
    """The file as TOML, read once a process (None: there is none)."""
    path = config_path()
    if not path.is_file():
        if os.environ.get("MMKV_CONFIG"):
            raise UsageError(f"MMKV_CONFIG names {path}, which is not a file")
        return None
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)  # never more than a config can be
    except OSError as err:
        raise UsageError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UsageError(f"{path}: over {MAX_CONFIG_BYTES // 1024} KiB, too large for a config")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError(f"{path}: cannot be read ({err})") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"{path}: not TOML: {err}") from None
    except RecursionError:  # tables or arrays nested thousands deep
        raise UsageError(f"{path}: not TOML mmkv reads: nested too deep") from None


def file_values() -> dict[str, Any]:
    """The keys the file sets (dotted for the server's), as written there."""
    data = _written() or {}
    flat = {key: value for key, value in data.items() if key != "serve"}
    flat.update({f"serve.{key}": value for key, value in (data.get("serve") or {}).items()})
    return flat


def seconds_of(text: str | float | int, what: str) -> float:
    """A duration as ollama's keep_alive takes it: seconds, or '30s', '5m', '1h' (0: at once;
    negative: never)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        return float(text)
    if isinstance(text, str):
        stripped = text.strip()
        negative = stripped.startswith("-")
        match = _DURATION.fullmatch(stripped.lstrip("-"))
        if match:
            value = float(match.group(1)) * _SECONDS[match.group(2)]
            return -value if negative else value
    raise UsageError(f"{what} must be a duration (300, '30s', '5m', '1h'), not {str(text)[:60]!r}")
