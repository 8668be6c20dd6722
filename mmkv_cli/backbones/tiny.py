"""Tiny offline backbones: the real model classes at toy size, deterministic random weights, a
WordLevel tokenizer and processors built from constructor arguments. Tests and demos run on these,
no hub needed."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = [
    "[UNK]",
    "[PAD]",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<image>",
    "<video>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = """system user assistant you are a an helpful . , ? ! : ' - what which who when where how
many much is are was were the of in on at to and or it its this that there here do does did color
colour shape circle square triangle star ring cross red green blue yellow orange purple white black
gray first last before after next happened appeared shown moving left right up down top bottom
middle one two three four five six seven eight nine ten zero yes no frame second seconds time clip
video image page document answer question letter option with without shapes now""".split()
WORDS += [str(i) for i in range(64)] + list("abcdefghij")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(SPECIAL + WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        eos_token="<|im_end|>",
        additional_special_tokens=[t for t in SPECIAL if t not in ("[UNK]", "[PAD]")],
    )


def _text_config(vocab: int, **extra) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        **extra,
    )


def _ids(tokenizer, *names: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(n) for n in names]


def _seeded(model_class, config, seed: int):
    torch.manual_seed(seed)
    return model_class(config).eval()


def build_tiny_llava_ov(seed: int = 0):
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    tokenizer = tiny_tokenizer()
    image_id, video_id, eos = _ids(tokenizer, "<image>", "<video>", "<|im_end|>")
    config = LlavaOnevisionConfig(
        text_config=dict(
            model_type="qwen2", **_text_config(256, eos_token_id=eos, bos_token_id=None)
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=4,
        ),
        image_token_index=image_id,
        video_token_index=video_id,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    processor = LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32})
    return _seeded(LlavaOnevisionForConditionalGeneration, config, seed), tokenizer, processor


def _qwen_special_ids(tokenizer) -> dict:
    image_id, video_id, start_id, end_id = _ids(
        tokenizer, "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
    )
    return dict(
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )


def _qwen_text(tokenizer, **rope_extra) -> dict:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # head_dim 16 -> 8 rotary pairs split over (temporal, height, width)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], **rope_extra}
    return _text_config(256, rope_parameters=rope, eos_token_id=eos, bos_token_id=None)


# Every tiny Qwen turns a 64x64 frame pair into 8x8 patches merged 2x2: 16 LLM tokens per temporal
# step.
QWEN_VISION = dict(patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
QWEN_FRAMES = dict(patch_size=8, temporal_patch_size=2, merge_size=2)


def _qwen2_frames():
    """The Qwen2 / Qwen2.5 video processor: every frame resized to 64x64."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(
        **QWEN_FRAMES,
        size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64},
        cap_pixels_per_frame=False,
    )


def build_tiny_qwen2_vl(seed: int = 0):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = tiny_tokenizer()
    config = Qwen2VLConfig(
        text_config=_qwen_text(tokenizer),
        vision_config=dict(
            depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, **QWEN_VISION
        ),
        **_qwen_special_ids(tokenizer),
    )
    processor = _qwen2_frames()
    return _seeded(Qwen2VLForConditionalGeneration, config, seed), tokenizer, processor


def build_tiny_qwen2_5_vl(seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_tokenizer()
    # window_size 32 px = 2x2 merged units: windowed and full-attention blocks are both exercised
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text(tokenizer),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=32,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
            **QWEN_VISION,
        ),
        **_qwen_special_ids(tokenizer),
    )
    processor = _qwen2_frames()
    return _seeded(Qwen2_5_VLForConditionalGeneration, config, seed), tokenizer, processor


def build_tiny_qwen3_vl(seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = tiny_tokenizer()
    config = Qwen3VLConfig(
        text_config=_qwen_text(tokenizer, mrope_interleaved=True),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
            **QWEN_VISION,
        ),
        **_qwen_special_ids(tokenizer),
    )
    # Qwen3 bounds the pixels of a whole clip: 4 frames of 128x128 fit, 16 are shrunk to 64x64, so a
    # chunked encode must carry the clip's size to every chunk.
    processor = Qwen3VLVideoProcessor(
        **QWEN_FRAMES,
        size={"shortest_edge": 16 * 16, "longest_edge": 128 * 128 * 4},
        do_sample_frames=False,
    )
    return _seeded(Qwen3VLForConditionalGeneration, config, seed), tokenizer, processor
