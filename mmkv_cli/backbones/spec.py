"""Model presets (presets/models/*.yaml): the typed fields a preset may set, and the lookup of a
model name that is a preset (anything else is an HF id or a local folder)."""

from __future__ import annotations

import difflib
import functools
import os
import re
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.backbones import FamilyName
from mmkv_cli.core.config import config
from mmkv_cli.core.errors import ModelError, UsageError
from mmkv_cli.core.spec import knob, override
from mmkv_cli.presets import NAME, find_preset, preset_names, read_preset


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


PAPERS_MODEL = "llava-ov-0.5b"  # the seed papers' backbone: the model when nothing names one


def default_model() -> str:
    """$MMKV_MODEL, else the config file's model, else the papers' backbone."""
    return os.environ.get("MMKV_MODEL") or config().model or PAPERS_MODEL


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


BUILT_IN = ("tiny", "demo", "demo-grid", "rehearsal")  # sources built here, never fetched
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
HUB_PROBE_S = (
    1.5  # how long the hub may take to accept a connection before it counts as unreachable
)


def check_available(name: str | None) -> None:
    """Refuse, at once and without torch, a model that cannot load here: a name that is neither a
    preset, a folder nor a hub id (with the nearest preset), or a hub checkpoint that is not on this
    machine while the hub is offline or unreachable (with what to do instead)."""
    name = name or default_model()
    spec = load_model_spec(name)
    source = spec.source if spec is not None else name
    if source in BUILT_IN or os.path.isdir(source):
        return
    if not HUB_ID.fullmatch(source):
        near = difflib.get_close_matches(name, model_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise UsageError(
            f"unknown model '{name}': {hint}(`mmkv models` lists the presets; a checkpoint is a "
            "hub id ORG/NAME or a local folder)"
        )
    if in_hub_cache(source):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    if offline or not _hub_reachable():
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub cannot be reached"
        raise ModelError(
            f"model '{name}' ({source}) is not on this machine and {why}: try --model demo (built "
            f"in; it answers about the synthetic shape clips), or download it where there is "
            f"network (`hf download {source}`) and pass its folder with --model"
        )


def where_weights(source: str) -> str:
    """Where a preset's weights are: "built in" (made here), "here" (a local folder, or the hub
    cache holds its config), or "hub" (to be downloaded). No network, no torch."""
    if source in BUILT_IN:
        return "built in"
    if os.path.isdir(source) or (HUB_ID.fullmatch(source) and in_hub_cache(source)):
        return "here"
    return "hub"


def in_hub_cache(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # not a repo id the hub library accepts
        return False


@functools.cache  # once a process: encode checks before torch loads, load_backbone again
def _hub_reachable() -> bool:
    """Whether the hub accepts a connection within HUB_PROBE_S (name lookup included, which has
    no timeout of its own: it runs on a thread that is left behind if it hangs)."""
    import socket
    import threading
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    reached: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((endpoint.hostname, endpoint.port or 443), HUB_PROBE_S):
                reached.append(True)
        except OSError:
            pass

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(HUB_PROBE_S)
    return bool(reached)


def model_listing() -> list[dict]:
    """Every model preset with its family, source, description and where its weights are, as
    `mmkv models --json` lists them."""
    rows = []
    for name in model_names():
        spec = load_model_spec(name) or ModelSpec()
        rows.append(
            {
                "name": name,
                "family": spec.family,
                "source": spec.source,
                "weights": where_weights(spec.source),
                "description": spec.description,
                "default": name == default_model(),
            }
        )
    return rows


def model_spec(name: str | None) -> ModelSpec:
    """The settings a model runs with: its preset's, or the defaults for an HF id or a folder."""
    return load_model_spec(name or default_model()) or ModelSpec()
