"""Loading a backbone: a preset name, an HF id or a local path -> a loaded Backbone adapter."""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import replace

import torch

from mmkv_cli.backbones import FAMILIES, tiny
from mmkv_cli.backbones.base import Backbone, PromptPieces, text_kv
from mmkv_cli.backbones.demo import build_demo
from mmkv_cli.backbones.rehearsal import build_rehearsal, rehearsal_shape
from mmkv_cli.backbones.spec import (
    ModelSpec,
    check_available,
    default_model,
    load_model_spec,
    model_names,
)
from mmkv_cli.core import logs
from mmkv_cli.core.config import config
from mmkv_cli.core.errors import ModelError, UsageError
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.core.runtime import require_supported

LOG = logs.get(__name__)

__all__ = ["load_backbone", "planned_kv", "resolve_device", "resolve_dtype"]
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def adapter_for(family: str) -> tuple[type[Backbone], PromptPieces]:
    """The Backbone subclass of `family` and its prompt pieces (imports the adapter's module)."""
    entry = FAMILIES[family]
    module = importlib.import_module(f"mmkv_cli.backbones.{entry.module}")
    return vars(module)[entry.adapter], vars(module)["PROMPT"]


def tiny_builder(family: str):
    """The builder of a small random model of `family`: seed -> (model, tokenizer, processor)."""
    return vars(tiny)[FAMILIES[family].tiny_builder]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"unknown device '{device}' (auto, cpu, cuda, cuda:N)")
    return torch.device(device)


def placed(options: LoadOptions) -> LoadOptions:
    """`options` with its model and device as the load will resolve them (the default model where
    none is named; the config's device where "auto" was left, then this machine's), so a default
    and what it means name the same weights."""
    device = options.device
    if device == "auto" and config().device:
        device = config().device
    where = resolve_device(device)
    name = f"cuda:{where.index or 0}" if where.type == "cuda" else where.type
    return replace(options, model=options.model or default_model(), device=name)


def resolve_dtype(dtype: str, device: torch.device, tiny: bool) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and not tiny else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}' (auto, {', '.join(sorted(set(DTYPES)))})")
    return DTYPES[dtype]


def load_backbone(options: LoadOptions | None = None) -> Backbone:
    """The backbone `options.model` names (a preset, an HF id or a folder), its preset resolved once
    and carried on it as `backbone.spec`."""
    started = time.perf_counter()
    backbone = _build(options or LoadOptions())
    parameter = next(backbone.model.parameters())
    LOG.info(
        "loaded model %s (%s) on %s in %s in %.2f s",
        backbone.name,
        backbone.family,
        parameter.device,
        str(parameter.dtype).removeprefix("torch."),
        time.perf_counter() - started,
    )
    return backbone


def _build(options: LoadOptions) -> Backbone:
    require_supported()  # an old torch or transformers named in one line, not deep in a model class
    chosen = config()  # the file's device and dtype where the caller left them to "auto"
    if options.device == "auto" and chosen.device:
        options = replace(options, device=chosen.device)
    if options.dtype == "auto" and chosen.dtype:
        options = replace(options, dtype=chosen.dtype)
    name = options.model or default_model()
    check_available(name)  # no network wait for a checkpoint that cannot come
    spec = load_model_spec(name)
    target = resolve_device(options.device)
    if spec is not None and spec.source == "rehearsal":  # real shapes, random weights, no hub
        spec = replace(spec, layers=options.layers or spec.layers)
        dtype = resolve_dtype(
            options.dtype if options.dtype != "auto" else spec.dtype, target, False
        )
        net, tokenizer, processor = build_rehearsal(
            spec.shape, spec.layers, spec.seed, target, dtype
        )
        adapter, prompt = adapter_for(spec.family)
        return adapter(net, tokenizer, processor, name=name, spec=spec, prompt=prompt)
    if spec is not None and spec.source in ("tiny", "demo", "demo-grid"):  # built in code
        if spec.source in ("demo", "demo-grid"):
            net, tokenizer, processor = build_demo(grid=spec.source == "demo-grid")
        else:
            net, tokenizer, processor = tiny_builder(spec.family)(spec.seed)
        dtype = options.dtype if options.dtype != "auto" else spec.dtype
        net = net.to(target, resolve_dtype(dtype, target, tiny=True))
        adapter, prompt = adapter_for(spec.family)
        return adapter(net, tokenizer, processor, name=name, spec=spec, prompt=prompt)
    spec = spec or ModelSpec(source=name)
    chosen = options.dtype if options.dtype != "auto" else spec.dtype
    return _load_pretrained(name, spec, target, resolve_dtype(chosen, target, tiny=False))


def planned_kv(options: LoadOptions) -> dict | None:
    """The KV the model `options` names would make ({layers, kv_heads, head_dim}), read from its
    config without building it or touching the network: a pack's shapes are checked against it
    before a 7B-wide model is built or downloaded. None where it cannot tell cheaply: the built-in
    small models (built in a blink, checked after) and a checkpoint not on this machine."""
    name = options.model or default_model()
    spec = load_model_spec(name)
    if spec is not None and spec.source == "rehearsal":
        shape = rehearsal_shape(spec.shape)
        layers = min(options.layers or spec.layers or shape["layers"], shape["layers"])
        return dict(shape, layers=layers)
    if spec is not None and spec.source in ("tiny", "demo", "demo-grid"):
        return None
    from transformers import AutoConfig

    source = (spec or ModelSpec(source=name)).source
    try:
        text = AutoConfig.from_pretrained(source, local_files_only=True).get_text_config()
    except Exception:  # noqa: BLE001 (not here: load_backbone says why, in its own words)
        return None
    return text_kv(text)


def _load_pretrained(name: str, spec: ModelSpec, device, dtype) -> Backbone:
    import transformers
    from transformers import AutoConfig, AutoProcessor

    source = spec.source

    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=offline)
    except Exception as err:  # hub errors come as OSError, ValueError or httpx errors
        known = ", ".join(model_names())
        raise ModelError(
            f"model '{source}' is not available locally and the Hugging Face hub cannot be "
            f"reached: download it where there is network (`hf download {source}`) and pass its "
            "folder with --model, "
            f"or pick a preset ({known})"
        ) from err
    family = config.model_type
    if family not in FAMILIES:
        raise ModelError(f"model '{source}' is a {family}; supported: {', '.join(FAMILIES)}")
    try:
        net = getattr(transformers, FAMILIES[family].hf_class).from_pretrained(
            source, dtype=dtype, local_files_only=offline
        )
        processor = AutoProcessor.from_pretrained(source, local_files_only=offline)
    except Exception as err:
        raise ModelError(f"cannot load model '{source}': {str(err).splitlines()[0]}") from err
    adapter, prompt = adapter_for(family)
    return adapter(
        net.to(device),
        processor.tokenizer,
        processor.video_processor,
        name=name,
        spec=replace(spec, family=family),
        prompt=prompt,
    )
