"""The demo backbone ships with the package and loads offline; missing weights are one clear error."""

import pytest

from mmkv_cli.backbones import load_backbone
from mmkv_cli.backbones.demo import WEIGHTS, build_demo
from mmkv_cli.errors import ModelError


def test_missing_or_foreign_weights_are_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="make demo-model"):
        build_demo(tmp_path / "none.safetensors")
    from safetensors.torch import save_file
    import torch

    save_file({"something.else": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelError, match="does not fit"):
        build_demo(tmp_path / "other.safetensors")


def test_demo_loads_offline_from_the_package():
    assert WEIGHTS.is_file() and WEIGHTS.stat().st_size < 16 * 2**20
    backbone = load_backbone("demo", "cpu")
    assert backbone.family == "llava_onevision" and backbone.tokens_per_step((128, 128)) == 4
    assert backbone.fingerprint()["source"] == "demo"
