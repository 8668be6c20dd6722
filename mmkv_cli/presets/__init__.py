"""Presets: named variants of the methods and the models, as YAML files that only override typed
fields.

Built-in presets ship inside the package (methods/*.yaml, models/*.yaml beside this file, read
through importlib.resources, so a wheel works). User presets override them by name: `--presets DIR`
first, then $MMKV_PRESETS, then the built-in ones. Every method in code is also a preset of its own
name.

A method preset: `extends` (the method or preset it varies; a file named after a method in code
extends it implicitly), `description`, `budget` (a share) or `budget_tokens`, and `params` (fields
of the method's parameter class). A model preset: fields of ModelSpec. Anything else is refused,
with the file and the key, before any work starts.

This module only finds and reads the files; what they mean is the stages' own: method presets
resolve in mmkv_cli.methods.choice, model presets in mmkv_cli.backbones.spec.
"""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mmkv_cli.core import logs
from mmkv_cli.core.errors import UsageError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

LOG = logs.get(__name__)
_user_folder: Path | None = None  # set by `--presets DIR`


def use_presets(folder: str | Path | None) -> None:
    """Make `folder` (with methods/ and models/ inside) the first place presets are looked up."""
    global _user_folder
    if folder is not None and not Path(folder).is_dir():
        raise UsageError(f"--presets: no such folder {folder}")
    _user_folder = Path(folder) if folder is not None else None
    if folder is not None:
        LOG.info("presets from %s first", folder)


def user_folders() -> list[Path]:
    """The folders of the user's own presets in effect (--presets, $MMKV_PRESETS, the config's)."""
    return _folders()[:-1]  # the last is the built-in one


def _folders() -> list:
    """Where presets are looked up, first match wins."""
    found: list = []
    if _user_folder is not None:
        found.append(_user_folder)
    if os.environ.get("MMKV_PRESETS"):
        found.append(Path(os.environ["MMKV_PRESETS"]))
    found.append(resources.files("mmkv_cli.presets"))
    return found


def find_preset(kind: str, name: str):
    if not NAME.fullmatch(name):
        raise UsageError(f"'{name}' is not a {kind[:-1]} name (letters, digits, '.', '_', '-')")
    for folder in _folders():
        path = folder / kind / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def preset_names(kind: str) -> set[str]:
    out = set()
    for folder in _folders():
        sub = folder / kind
        if sub.is_dir():
            out |= {p.name[: -len(".yaml")] for p in sub.iterdir() if p.name.endswith(".yaml")}
    return out


def read_preset(path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UsageError(f"cannot read preset {path}: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict):
        raise UsageError(f"preset {path} is not a mapping")
    return data
