"""Model presets (presets/models/*.yaml): the typed fields a preset may set, and the lookup of a
model name that is a preset (anything else is an HF id or a local folder)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.backbones import FamilyName
from mmkv_cli.errors import UsageError
from mmkv_cli.presets import NAME, find_preset, preset_names, read_preset
from mmkv_cli.spec import knob, override


@dataclass(frozen=True)
class ModelSpec:
    family: FamilyName | None = knob(None, "the model family (required in a preset)")
    source: str = knob(
        "", "HF id or local folder; 'tiny', 'demo' or 'demo-grid' for the built-in offline models"
    )
    description: str = knob("", "one line for `mmkv models`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "weights' dtype (auto: bfloat16 on CUDA, float32 on CPU)"
    )
    fps: float = knob(1.0, "frames sampled per second of video", above=0)
    max_frames: int = knob(64, "at most this many frames (thinned uniformly beyond)", low=1)
    seed: int = knob(0, "seed of the random weights (tiny and rehearsal models)", low=0)
    shape: str | None = knob(
        None, "source rehearsal: the real model whose language-model shapes are built"
    )
    layers: int | None = knob(None, "cut the language model to this many layers (null: all)", low=1)


def default_model() -> str:
    return os.environ.get("MMKV_MODEL") or "llava-ov-0.5b"


def model_names() -> list[str]:
    return sorted(preset_names("models"))


def load_model_spec(name: str) -> ModelSpec | None:
    """The model preset `name`, or None when `name` is not a preset (an HF id or a path)."""
    path = find_preset("models", name) if NAME.fullmatch(name) else None
    if path is None:
        return None
    spec = override(ModelSpec(), read_preset(path), str(path))
    if spec.family is None or not spec.source:
        raise UsageError(
            f"{path}: lacks the field '{'family' if spec.family is None else 'source'}'"
        )
    return spec


def model_spec(name: str | None) -> ModelSpec:
    """The settings a model runs with: its preset's, or the defaults for an HF id or a folder."""
    return load_model_spec(name or default_model()) or ModelSpec()
