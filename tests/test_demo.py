"""The demo backbone ships with the package and loads offline; missing weights are one clear
error."""

import pytest

from mmkv_cli.backbones.demo import WEIGHTS, build_demo
from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.core.errors import ModelError
from mmkv_cli.core.options import LoadOptions
from tests.helpers import ask_pack, encode_pack


def test_missing_or_foreign_weights_are_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="make demo-model"):
        build_demo(tmp_path / "none.safetensors")
    import torch
    from safetensors.torch import save_file

    save_file({"something.else": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelError, match="does not fit"):
        build_demo(tmp_path / "other.safetensors")


def test_demo_loads_offline_from_the_package():
    assert WEIGHTS.is_file() and WEIGHTS.stat().st_size < 16 * 2**20
    backbone = load_backbone(LoadOptions("demo", "cpu"))
    assert backbone.family == "llava_onevision" and backbone.tokens_per_step((128, 128)) == 4
    assert backbone.fingerprint()["source"] == "demo"


def test_demo_answers_the_sample_clip_from_its_pack(tmp_path):
    """samples/clip.mp4: a red circle, then a blue square, then a yellow triangle (2 fps, 8 s)."""

    backbone = load_backbone(LoadOptions("demo", "cpu"))
    pack = tmp_path / "clip.kvpack"
    encode_pack("samples/clip.mp4", pack, method="full", backbone=backbone)
    expected = {
        "what color is the circle ?": "red",
        "what color is the triangle ?": "yellow",
        "which shape appeared first ?": "circle",
        "which shape appeared last ?": "triangle",
        "how many shapes appeared ?": "three",
    }
    answers = {q: ask_pack(pack, q, backbone=backbone, max_new_tokens=4).answer for q in expected}
    assert answers == expected
    # asked at 3.5 s, only the circle and the square have been shown
    assert ask_pack(pack, "how many shapes appeared ?", backbone=backbone, at=3.5).answer == "two"
    assert ask_pack(pack, "what shape is shown now ?", backbone=backbone, at=3.5).answer == "square"
