"""Rehearsal backbones: the real model classes with the real language models' shapes, built offline
with random weights, for measuring cost at real width and real token counts (their answers are
noise).

The language model is exactly the published one (layers, hidden size, heads, KV heads, head dim,
MLP, vocabulary, RoPE / M-RoPE), so KV widths, compute and positions are real. The vision tower is
cheap (one small layer) but emits the real number of tokens per frame at the real LLM hidden size:
196 for LLaVA-OneVision (384 px, patch 14, pooled 2x2), 196 per frame pair for Qwen2.5-VL (392 px,
patch 14, merge 2). `layers` cuts the depth for CPU runs.
"""

from __future__ import annotations

import torch

from mmkv_cli.backbones.tiny import tiny_tokenizer
from mmkv_cli.core.errors import ModelError

# The language models' published configs (Qwen2-0.5B / Qwen2-7B under LLaVA-OneVision, Qwen2.5-VL).
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
QWEN2_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)
QWEN25VL_3B = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=128000,
    tie_word_embeddings=True,
)
QWEN25VL_7B = dict(QWEN2_7B, max_position_embeddings=128000)  # the same language model
SHAPES = {
    "llava-ov-0.5b": ("llava_onevision", QWEN2_05B),
    "llava-ov-7b": ("llava_onevision", QWEN2_7B),
    "qwen2.5-vl-3b": ("qwen2_5_vl", QWEN25VL_3B),
    "qwen2.5-vl-7b": ("qwen2_5_vl", QWEN25VL_7B),
}
ROPE_THETA = 1_000_000.0
CHEAP_VISION = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2)


def rehearsal_shape(shape: str | None) -> dict:
    """{layers, kv_heads, head_dim} of the published model `shape`, without building anything."""
    if shape not in SHAPES:
        raise ModelError(f"no rehearsal shape '{shape}' (known: {', '.join(SHAPES)})")
    text = SHAPES[shape][1]
    return {
        "layers": text["num_hidden_layers"],
        "kv_heads": text["num_key_value_heads"],
        "head_dim": text["hidden_size"] // text["num_attention_heads"],
    }


def _text(shape: dict, layers: int | None, tokenizer, **rope) -> dict:
    cut = dict(
        shape,
        num_hidden_layers=min(layers or shape["num_hidden_layers"], shape["num_hidden_layers"]),
    )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rope_parameters = {"rope_type": "default", "rope_theta": ROPE_THETA, **rope}
    return dict(cut, rope_parameters=rope_parameters, eos_token_id=eos, bos_token_id=None)


def _llava_ov(shape: dict, layers: int | None, tokenizer):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    ids = tokenizer.convert_tokens_to_ids
    config = LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **_text(shape, layers, tokenizer)),
        vision_config=dict(
            model_type="siglip_vision_model",
            num_hidden_layers=1,
            image_size=384,
            patch_size=14,
            **CHEAP_VISION,
        ),
        image_token_index=ids("<image>"),
        video_token_index=ids("<video>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    processor = LlavaOnevisionVideoProcessor(size={"height": 384, "width": 384})
    return LlavaOnevisionForConditionalGeneration, config, processor


def _qwen25_vl(shape: dict, layers: int | None, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    ids = tokenizer.convert_tokens_to_ids
    config = Qwen2_5_VLConfig(
        text_config=_text(shape, layers, tokenizer, mrope_section=[16, 24, 24]),
        vision_config=dict(
            depth=1,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=shape["hidden_size"],
            window_size=112,
            fullatt_block_indexes=[0],
            tokens_per_second=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    side = 392  # 28 x 28 patches of 14 px, merged 2 x 2: 196 tokens per frame pair
    processor = Qwen2VLVideoProcessor(
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        size={"shortest_edge": side * side, "longest_edge": side * side},
        cap_pixels_per_frame=False,
    )
    return Qwen2_5_VLForConditionalGeneration, config, processor


def build_rehearsal(shape: str, layers: int | None, seed: int, device, dtype):
    """(model on `device` in `dtype`, tokenizer, video processor) for the named real shape."""
    if shape not in SHAPES:
        raise ModelError(f"no rehearsal shape '{shape}' (known: {', '.join(SHAPES)})")
    family, text = SHAPES[shape]
    tokenizer = tiny_tokenizer()
    build = _llava_ov if family == "llava_onevision" else _qwen25_vl
    model_class, config, processor = build(text, layers, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):  # built where it runs: a 7B never passes through host memory
        model = model_class._from_config(config, dtype=dtype)
    return model.eval(), tokenizer, processor
