"""Backbone registry: a preset name, an HF id or a local path -> a loaded Backbone adapter."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from mmkv_cli.backbones import llava_onevision, qwen3_vl, qwen_vl
from mmkv_cli.backbones.base import Backbone, PromptPieces, StreamLayout
from mmkv_cli.backbones.demo import build_demo
from mmkv_cli.backbones.rehearsal import build_rehearsal
from mmkv_cli.backbones.tiny import TINY_BUILDERS
from mmkv_cli.errors import ModelError, UsageError
from mmkv_cli.options import LoadOptions
from mmkv_cli.presets import ModelSpec, default_model, load_model_spec, model_names

__all__ = [
    "Backbone",
    "PromptPieces",
    "StreamLayout",
    "load_backbone",
    "resolve_device",
    "default_model",
]

ADAPTERS = {
    "llava_onevision": (llava_onevision.LlavaOnevisionBackbone, llava_onevision.PROMPT),
    "qwen2_vl": (qwen_vl.QwenVLBackbone, qwen_vl.PROMPT),
    "qwen2_5_vl": (qwen_vl.Qwen25VLBackbone, qwen_vl.PROMPT),
    "qwen3_vl": (qwen3_vl.Qwen3VLBackbone, qwen3_vl.PROMPT),
}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise UsageError(f"unknown device '{device}' (auto, cpu, cuda, cuda:N)")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, tiny: bool) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and not tiny else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{dtype}' (auto, {', '.join(sorted(set(DTYPES)))})")
    return DTYPES[dtype]


def load_backbone(options: LoadOptions | None = None) -> Backbone:
    """The backbone `options.model` names (a preset, an HF id or a folder), its preset resolved once
    and carried on it as `backbone.spec`."""
    options = options or LoadOptions()
    name = options.model or default_model()
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
        adapter, prompt = ADAPTERS[spec.family]
        return adapter(net, tokenizer, processor, name=name, spec=spec, prompt=prompt)
    if spec is not None and spec.source in ("tiny", "demo", "demo-grid"):  # built in code
        if spec.source in ("demo", "demo-grid"):
            net, tokenizer, processor = build_demo(grid=spec.source == "demo-grid")
        elif spec.family in TINY_BUILDERS:
            net, tokenizer, processor = TINY_BUILDERS[spec.family](spec.seed)
        else:
            raise ModelError(f"no tiny builder for family '{spec.family}'")
        dtype = options.dtype if options.dtype != "auto" else spec.dtype
        net = net.to(target, resolve_dtype(dtype, target, tiny=True))
        adapter, prompt = ADAPTERS[spec.family]
        return adapter(net, tokenizer, processor, name=name, spec=spec, prompt=prompt)
    spec = spec or ModelSpec(source=name)
    chosen = options.dtype if options.dtype != "auto" else spec.dtype
    return _load_pretrained(name, spec, target, resolve_dtype(chosen, target, tiny=False))


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
    if family not in ADAPTERS:
        raise ModelError(f"model '{source}' is a {family}; supported: {', '.join(ADAPTERS)}")
    classes = {
        "llava_onevision": "LlavaOnevisionForConditionalGeneration",
        "qwen2_vl": "Qwen2VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
    }
    try:
        net = getattr(transformers, classes[family]).from_pretrained(
            source, dtype=dtype, local_files_only=offline
        )
        processor = AutoProcessor.from_pretrained(source, local_files_only=offline)
    except Exception as err:
        raise ModelError(f"cannot load model '{source}': {str(err).splitlines()[0]}") from err
    adapter, prompt = ADAPTERS[family]
    return adapter(
        net.to(device),
        processor.tokenizer,
        processor.video_processor,
        name=name,
        spec=replace(spec, family=family),
        prompt=prompt,
    )
