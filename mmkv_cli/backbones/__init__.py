"""The backbone registry: every supported model family, and where its adapter lives.

Light on purpose (no torch, no transformers): `mmkv models`, preset checks and the CLI's help read
the family names here; an adapter module is imported only when a model of its family loads
(loading.py, by the module and class names below). Adding a backbone: its adapter module, one row
here, a tiny builder in tiny.py and a `tiny-<family>` model preset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    """Where a model family's code is: the adapter and the checkpoint's transformers class."""

    module: str  # mmkv_cli.backbones.<module>: the adapter and its PROMPT
    adapter: str  # the Backbone subclass in that module
    hf_class: str  # transformers' class a checkpoint of this family loads as
    tiny_builder: str  # the builder in tiny.py of a small random model of this family
    # the adapter gives the vision tower's attention per visual token (token reducers that read it)
    tower_attention: bool = False
    # the adapter runs the vision tower reusing layers across frames (STC's cacher: SigLIP)
    tower_reuse: bool = False


FAMILIES: dict[str, Family] = {
    "llava_onevision": Family(
        "llava_onevision",
        "LlavaOnevisionBackbone",
        "LlavaOnevisionForConditionalGeneration",
        "build_tiny_llava_ov",
        tower_attention=True,
        tower_reuse=True,
    ),
    "qwen2_vl": Family(
        "qwen_vl",
        "QwenVLBackbone",
        "Qwen2VLForConditionalGeneration",
        "build_tiny_qwen2_vl",
        tower_attention=True,
    ),
    "qwen2_5_vl": Family(
        "qwen_vl",
        "Qwen25VLBackbone",
        "Qwen2_5_VLForConditionalGeneration",
        "build_tiny_qwen2_5_vl",
        tower_attention=True,
    ),
    "qwen3_vl": Family(
        "qwen3_vl",
        "Qwen3VLBackbone",
        "Qwen3VLForConditionalGeneration",
        "build_tiny_qwen3_vl",
        tower_attention=True,
    ),
}
# a family's name, as a preset's `family:` field is typed (its values come from FAMILIES)
FamilyName = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]


def tower_families() -> list[str]:
    """The families whose adapters expose the vision tower's attention."""
    return [name for name, family in FAMILIES.items() if family.tower_attention]


def reuse_families() -> list[str]:
    """The families whose adapters run the vision tower reusing layers across frames."""
    return [name for name, family in FAMILIES.items() if family.tower_reuse]
