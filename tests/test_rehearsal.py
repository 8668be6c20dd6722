"""Rehearsal backbones: the real language-model shapes (KV width, tokens per frame, M-RoPE) built
offline with random weights, at a cut depth, through the ordinary encode and ask path."""

import pytest

from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.backbones.spec import load_model_spec
from mmkv_cli.core.options import LoadOptions
from tests.conftest import SAMPLES
from tests.helpers import ask_pack, encode_pack

REAL = {  # (KV heads, head dim, depth, position dims) of the published language models
    "rehearsal-llava-ov-0.5b": (2, 64, 24, 1),
    "rehearsal-qwen2.5-vl-3b": (2, 128, 36, 3),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_rehearsal_models_have_real_widths_and_real_tokens_per_frame(tmp_path, name):
    kv_heads, head_dim, depth, dims = REAL[name]
    spec = load_model_spec(name)
    assert spec.source == "rehearsal" and "answers are noise" in spec.description
    backbone = load_backbone(LoadOptions(name, "cpu", layers=1))
    assert backbone.kv_shape() == {
        "layers": 1,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": "float32",
    }
    assert backbone.position_dims == dims and backbone.tokens_per_step((128, 128)) == 196
    assert backbone.model.config.get_text_config().num_hidden_layers == 1 < depth
    info = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "r.kvpack",
        method="hermes",
        budget_tokens=200,
        backbone=backbone,
        fps=2.0,
        max_frames=4,
    )
    assert info["visual_tokens_total"] == 4 * 196 // backbone.frames_per_step
    assert max(layer["tokens_kept"] for layer in info["layers"]) <= 200
    per_token = 2 * kv_heads * head_dim * 4
    assert info["kv_bytes"] == sum(l["tokens_kept"] for l in info["layers"]) * per_token  # noqa: E741
    answer = ask_pack(tmp_path / "r.kvpack", "what ?", backbone=backbone, max_new_tokens=1)
    assert answer.context_tokens > 0


def test_a_pack_of_a_cut_depth_is_asked_at_that_depth(tmp_path):
    """A CPU bench's pack holds one layer of a rehearsal model: `mmkv ask` rebuilds the model at
    the depth the pack records, and a model of another depth is refused saying so."""
    from mmkv_cli import api
    from mmkv_cli.core.errors import PackError

    name = "rehearsal-llava-ov-0.5b"
    pack = tmp_path / "one-layer.kvpack"
    encode_pack(
        SAMPLES / "clip.mp4",
        pack,
        method="recency",
        backbone=load_backbone(LoadOptions(name, "cpu", layers=1)),
        max_frames=2,
    )
    session = api.PackSession(pack, load=LoadOptions(device="cpu"))
    assert session.backbone.kv_shape()["layers"] == 1
    assert session.ask("what ?").context_tokens > 0
    deeper = session.backbone  # as a 2-layer build of it would describe itself
    deeper.model.config.get_text_config().num_hidden_layers = 2
    with pytest.raises(PackError, match=r"another configuration of .*1 layer; here: .*2 layers"):
        api.ask(pack, "what ?", backbone=deeper)
