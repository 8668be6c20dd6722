"""LLaVA-OneVision: SigLIP frames pooled 2x2, a Qwen2 language model with 1-D RoPE, one newline
after a video."""

from __future__ import annotations

import math

import numpy as np
import torch

from mmkv_cli.backbones.base import Backbone, PromptPieces, StreamLayout
from mmkv_cli.backbones.tower_attention import layer_inputs, siglip_received
from mmkv_cli.backbones.tower_reuse import run_reusing

PROMPT = PromptPieces(
    prefix="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
    suffix_text="",
    question="\n{question}<|im_end|>\n<|im_start|>assistant\n",
)


class LlavaOnevisionBackbone(Backbone):
    family = "llava_onevision"
    positions_scan = True  # 1-D RoPE
    position_dims = 1
    frames_per_step = 1

    def visual_grid(self, frame_hw: tuple[int, int]) -> tuple[int, int]:
        # Every frame is resized to the vision tower's square input, then pooled to ceil(side / 2).
        vision = self.model.config.vision_config
        side = math.ceil((vision.image_size // vision.patch_size) / 2)
        return side, side

    def tokens_per_step(self, frame_hw: tuple[int, int]) -> int:
        h, w = self.visual_grid(frame_hw)
        return h * w

    def prepare(self, frames: np.ndarray, layout: StreamLayout | None) -> dict:
        return self.video_processor(videos=[frames], return_tensors="pt")

    @torch.inference_mode()
    def visual_embeds(self, frames: np.ndarray, inputs: dict | None = None) -> torch.Tensor:
        pixels = (inputs or self.prepare(frames, None))["pixel_values_videos"]
        config = self.model.config
        out = self.model.model.get_video_features(
            pixels.to(self.device, self.dtype, non_blocking=True),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        return out.pooler_output[:, :-1]  # the trailing newline belongs to the suffix

    @torch.inference_mode()
    def visual_chunk_scored(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """The chunk's tokens, and the attention each got in the tower's feature layer, pooled to
        the token grid as the features are (bilinear, as apply_pooling does)."""
        config = self.model.config
        layers = self.model.model.vision_tower.encoder.layers
        at = config.vision_feature_layer
        attention = layers[at if at < 0 else at - 1].self_attn
        with layer_inputs(attention) as calls:
            embeds = self.visual_embeds(frames, inputs)
        patches = torch.cat([siglip_received(attention, *call) for call in calls])
        if config.vision_feature_select_strategy == "default":
            patches = patches[:, 1:]  # the class token is not a feature
        side = math.isqrt(patches.shape[1])
        pooled = torch.nn.functional.interpolate(
            patches.view(-1, 1, side, side), size=layout.grid, mode="bilinear"
        )
        return embeds, {}, pooled.flatten(1)

    @torch.inference_mode()
    def visual_chunk_reusing(self, frames, step_times, layout, inputs, reuse):
        state, every, share = reuse
        layers = self.model.model.vision_tower.encoder.layers
        embeds, after = run_reusing(layers, state, every, share,
                                    lambda: self.visual_embeds(frames, inputs))  # fmt: skip
        return embeds, {}, after

    @torch.inference_mode()
    def suffix_embeds(self) -> torch.Tensor:
        newline = self.model.model.image_newline.view(1, 1, -1).to(self.dtype)
        text = self.text_ids(self.prompt.suffix_text)
        return torch.cat([newline, self.embed_ids(text)], dim=1) if text else newline

    def stream_layout(
        self,
        frame_hw: tuple[int, int],
        step_times: list[tuple[float, float]],
        clip_frames: int | None = None,
    ) -> StreamLayout:
        steps = len(step_times)
        n_prefix = len(self.text_ids(self.prompt.prefix))
        n_visual = steps * self.tokens_per_step(frame_hw)
        n_suffix = 1 + len(self.text_ids(self.prompt.suffix_text))
        pos = torch.arange(n_prefix + n_visual + n_suffix).unsqueeze(0)
        return StreamLayout(
            prefix=pos[:, :n_prefix],
            visual=pos[:, n_prefix : n_prefix + n_visual],
            suffix=pos[:, n_prefix + n_visual :],
            next_position=int(pos.shape[1]),
            rope_delta=0,
            step_lengths=[self.tokens_per_step(frame_hw)] * steps,
            grid=self.visual_grid(frame_hw),
        )
