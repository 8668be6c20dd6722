"""YAML presets (presets/methods/*.yaml, presets/models/*.yaml) -> validated dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmkv_cli.errors import UsageError


def presets_dir() -> Path:
    """The presets folder: $MMKV_PRESETS, else the repository's top-level presets/."""
    override = os.environ.get("MMKV_PRESETS")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "presets"


@dataclass(frozen=True)
class MethodPreset:
    name: str
    description: str
    paper: str
    budget: float  # default fraction of visual tokens kept
    params: dict[str, Any] = field(default_factory=dict)
    implements: str = ""  # the method module that runs it: its own name, or the preset it extends


@dataclass(frozen=True)
class ModelPreset:
    name: str
    family: str  # llava_onevision | qwen2_vl | qwen2_5_vl | qwen3_vl
    source: str  # HF id or local path; "tiny" for the offline builders
    description: str
    dtype: str
    fps: float
    max_frames: int
    params: dict[str, Any] = field(default_factory=dict)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise UsageError(f"cannot read preset {path}: {err}") from err
    if not isinstance(data, dict):
        raise UsageError(f"preset {path} is not a mapping")
    return data


def _require(data: dict[str, Any], key: str, path: Path) -> Any:
    if key not in data:
        raise UsageError(f"preset {path} lacks the field '{key}'")
    return data[key]


def _names(kind: str) -> list[str]:
    folder = presets_dir() / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def method_names() -> list[str]:
    return _names("methods")


def model_names() -> list[str]:
    return _names("models")


def load_method_preset(name: str) -> MethodPreset:
    path = presets_dir() / "methods" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(method_names()) or "none"
        raise UsageError(f"unknown method '{name}' (known: {known})")
    data = _read_yaml(path)
    params = dict(data.get("params") or {})
    base = None
    if data.get("extends"):  # a variant: the base preset's fields and params, these on top
        if data["extends"] == name:
            raise UsageError(f"preset {path} extends itself")
        base = load_method_preset(str(data["extends"]))
        params = {**base.params, **params}
    budget = float(data.get("budget", base.budget if base else 1.0))
    check_budget(budget)
    return MethodPreset(
        name=name,
        description=str(data.get("description", base.description if base else "")),
        paper=str(data.get("paper", base.paper if base else "")),
        budget=budget,
        params=params,
        implements=str(data.get("implements") or (base.implements if base else name)),
    )


def load_model_preset(name: str) -> ModelPreset | None:
    """The preset called `name`, or None when `name` is not a preset (an HF id or a path)."""
    path = presets_dir() / "models" / f"{name}.yaml"
    if not path.is_file():
        return None
    data = _read_yaml(path)
    return ModelPreset(
        name=name,
        family=str(_require(data, "family", path)),
        source=str(_require(data, "source", path)),
        description=str(data.get("description", "")),
        dtype=str(data.get("dtype", "auto")),
        fps=float(data.get("fps", 1.0)),
        max_frames=int(data.get("max_frames", 64)),
        params=dict(data.get("params") or {}),
    )


def check_budget(budget: float) -> float:
    if not (0.0 < budget <= 1.0):
        raise UsageError(f"budget must be in (0, 1], got {budget}")
    return budget
