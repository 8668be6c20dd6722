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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from mmkv_cli.errors import UsageError
from mmkv_cli.methods import METHODS, Budget, Method
from mmkv_cli.methods.base import GuidedParams
from mmkv_cli.spec import knob, override

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
METHOD_KEYS = ("extends", "description", "budget", "budget_tokens", "params")
Family = Literal["llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]

_user_folder: Path | None = None  # set by `--presets DIR`


def use_presets(folder: str | Path | None) -> None:
    """Make `folder` (with methods/ and models/ inside) the first place presets are looked up."""
    global _user_folder
    if folder is not None and not Path(folder).is_dir():
        raise UsageError(f"--presets: no such folder {folder}")
    _user_folder = Path(folder) if folder is not None else None


def _folders() -> list:
    """Where presets are looked up, first match wins."""
    found: list = []
    if _user_folder is not None:
        found.append(_user_folder)
    if os.environ.get("MMKV_PRESETS"):
        found.append(Path(os.environ["MMKV_PRESETS"]))
    found.append(resources.files("mmkv_cli.presets"))
    return found


def _find(kind: str, name: str):
    if not NAME.fullmatch(name):
        raise UsageError(f"'{name}' is not a {kind[:-1]} name (letters, digits, '.', '_', '-')")
    for folder in _folders():
        path = folder / kind / f"{name}.yaml"
        if path.is_file():
            return path
    return None


def _names(kind: str) -> set[str]:
    out = set()
    for folder in _folders():
        sub = folder / kind
        if sub.is_dir():
            out |= {p.name[: -len(".yaml")] for p in sub.iterdir() if p.name.endswith(".yaml")}
    return out


def _read(path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UsageError(f"cannot read preset {path}: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict):
        raise UsageError(f"preset {path} is not a mapping")
    return data


# --- methods ---


@dataclass(frozen=True)
class MethodChoice:
    """A method as a user names it: one in code, or a preset over one, with its typed parameters."""

    name: str
    method: Method
    params: Any  # an instance of method.params
    budget: Budget | None  # None: the method keeps every token
    description: str

    def with_budget(self, share: float | None = None, tokens: int | None = None) -> MethodChoice:
        """The command line's budget: a share (--budget) or a token count (--budget-tokens)."""
        if share is None and tokens is None:
            return self
        flag = "--budget" if share is not None else "--budget-tokens"
        if self.method.keeps_all:
            raise UsageError(f"method '{self.name}' keeps every token: {flag} does not apply")
        if share is not None and tokens is not None:
            raise UsageError("give --budget (a share) or --budget-tokens, not both")
        if tokens is not None and tokens < 1:
            raise UsageError(f"--budget-tokens must be at least 1, got {tokens}")
        budget = Budget(tokens=tokens) if tokens is not None else Budget(share=check_budget(share))
        return replace(self, budget=budget)

    def with_guidance(self, prompt: str | None) -> MethodChoice:
        """Refuse `--guidance-prompt` for a method that scores by no prompt."""
        if prompt is not None:
            if not isinstance(self.params, GuidedParams):
                raise UsageError(f"method '{self.name}' uses no guidance prompt")
            if not prompt.strip():
                raise UsageError("--guidance-prompt is empty")
        return self


def check_budget(budget: float) -> float:
    if not (0.0 < budget <= 1.0):
        raise UsageError(f"budget must be in (0, 1], got {budget:g}")
    return float(budget)


def method_names() -> list[str]:
    return sorted(set(METHODS) | _names("methods"))


def resolve_method(name: str, _seen: tuple[str, ...] = ()) -> MethodChoice:
    """The method or preset called `name`, its parameters checked against their types and ranges."""
    path = _find("methods", name)
    if path is None:
        if name in METHODS:
            method = METHODS[name]
            return MethodChoice(name, method, method.params(), method.budget, method.description)
        raise UsageError(f"unknown method '{name}' (known: {', '.join(method_names())})")
    if name in _seen:
        raise UsageError(f"preset {path} extends itself (through {' -> '.join(_seen)})")
    data = _read(path)
    for key in data:
        if key not in METHOD_KEYS:
            raise UsageError(f"{path}: unknown key '{key}' (known: {', '.join(METHOD_KEYS)})")
    base_name = data.get("extends", name if name in METHODS else None)
    if not isinstance(base_name, str):
        raise UsageError(f"{path}: 'extends' must name a method ({', '.join(METHODS)})")
    if base_name == name and name in METHODS:  # a user file named after a method in code
        method = METHODS[name]
        base = MethodChoice(name, method, method.params(), method.budget, method.description)
    else:
        base = resolve_method(base_name, (*_seen, name))
    params = override(base.params, data.get("params") or {}, f"{path}: params")
    description = data.get("description", base.description)
    if not isinstance(description, str):
        raise UsageError(f"{path}: description must be text")
    choice = MethodChoice(name, base.method, params, base.budget, description)
    for key, flag in (("budget", "share"), ("budget_tokens", "tokens")):
        if key in data:
            value = data[key]
            wanted = float if key == "budget" else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{path}: {key}: expected a number, got {value!r}")
            if wanted is int and not isinstance(value, int):
                raise UsageError(f"{path}: {key}: expected a whole number, got {value!r}")
            try:
                choice = choice.with_budget(**{flag: wanted(value)})
            except UsageError as err:
                raise UsageError(f"{path}: {key}: {err}") from None
    return choice


# --- models ---


@dataclass(frozen=True)
class ModelSpec:
    family: Family | None = knob(None, "the model family (required in a preset)")
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
    return sorted(_names("models"))


def load_model_spec(name: str) -> ModelSpec | None:
    """The model preset `name`, or None when `name` is not a preset (an HF id or a path)."""
    path = _find("models", name) if NAME.fullmatch(name) else None
    if path is None:
        return None
    spec = override(ModelSpec(), _read(path), str(path))
    if spec.family is None or not spec.source:
        raise UsageError(
            f"{path}: lacks the field '{'family' if spec.family is None else 'source'}'"
        )
    return spec
