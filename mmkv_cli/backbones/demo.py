"""The demo backbone: a small LLaVA-OneVision trained on the synthetic world
(scripts/train_demo_model.py).

Its architecture lives here, its weights ship with the package (assets/demo.safetensors), so
`--model demo` answers questions about shape clips on any machine, offline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmkv_cli.backbones.tiny import tiny_tokenizer
from mmkv_cli.core.errors import ModelError

ASSETS = Path(__file__).resolve().parent.parent / "assets"
WEIGHTS = ASSETS / "demo.safetensors"
GRID_WEIGHTS = ASSETS / "demo-grid.safetensors"
FRAME_SIDE = 32  # the vision tower's input; 8 px patches pooled 2x2 -> 4 tokens per frame
GRID_SIDE = 64  # demo-grid: 8 x 8 patches pooled 2x2 -> 4 x 4 = 16 tokens per frame


def demo_architecture(frame_side: int = FRAME_SIDE):
    """(untrained model, tokenizer, video processor): the training script and the loader share
    it. frame_side: FRAME_SIDE for demo, GRID_SIDE for demo-grid (the same networks otherwise)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = tiny_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2",
            vocab_size=256,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            eos_token_id=ids("<|im_end|>"),
            bos_token_id=None,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=96,
            intermediate_size=192,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=frame_side,
            patch_size=8,
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    processor = LlavaOnevisionVideoProcessor(size={"height": frame_side, "width": frame_side})
    torch.manual_seed(0)
    return LlavaOnevisionForConditionalGeneration(config), tokenizer, processor


def build_demo(weights: Path | None = None, grid: bool = False):
    """The trained demo (or demo-grid) model, ready for inference."""
    from safetensors.torch import load_file

    path = weights or (GRID_WEIGHTS if grid else WEIGHTS)
    if not path.is_file():
        raise ModelError(
            f"the demo backbone's weights are missing ({path}): build them with `make demo-model`"
        )
    model, tokenizer, processor = demo_architecture(GRID_SIDE if grid else FRAME_SIDE)
    try:
        missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    except Exception as err:
        raise ModelError(
            f"cannot load the demo weights {path}: {str(err).splitlines()[0]}"
        ) from err
    if missing or unexpected:
        raise ModelError(
            f"{path} does not fit the demo architecture ({len(missing)} missing, "
            f"{len(unexpected)} unexpected tensors): rebuild it with `make demo-model`"
        )
    return model.eval(), tokenizer, processor
