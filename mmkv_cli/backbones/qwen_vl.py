"""Qwen2-VL and Qwen2.5-VL: 2-frame temporal patches, 2x2 spatial merge, 3-D M-RoPE positions."""

from __future__ import annotations

import numpy as np
import torch
from transformers.vision_utils import get_vision_window_index

from mmkv_cli.backbones.base import Backbone, PromptPieces, StreamLayout
from mmkv_cli.backbones.tower_attention import layer_inputs, qwen_received

PROMPT = PromptPieces(
    prefix="<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|>",
    suffix_text="<|vision_end|>",
    question="{question}<|im_end|>\n<|im_start|>assistant\n",
)


class QwenVLBackbone(Backbone):
    family = "qwen2_vl"
    position_dims = 3

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grids: dict[tuple[int, int], tuple[int, int]] = {}  # frame size -> LLM token grid

    @property
    def frames_per_step(self) -> int:  # type: ignore[override]
        return int(self.video_processor.temporal_patch_size)

    def _process(self, frames: np.ndarray) -> dict:
        return self.video_processor(videos=[frames], return_tensors="pt", do_sample_frames=False)

    def visual_grid(self, frame_hw: tuple[int, int]) -> tuple[int, int]:
        """LLM tokens (rows, cols) of one temporal step for frames of this size."""
        if frame_hw not in self._grids:
            self._grids[frame_hw] = self._probe_grid(frame_hw)
        return self._grids[frame_hw]

    def _probe_grid(self, frame_hw: tuple[int, int]) -> tuple[int, int]:
        # The processor decides the resize; ask it rather than re-deriving its rounding rules.
        probe = np.zeros((self.frames_per_step, *frame_hw, 3), dtype=np.uint8)
        _, h, w = self._process(probe)["video_grid_thw"][0].tolist()
        merge = self.video_processor.merge_size
        return h // merge, w // merge

    def tokens_per_step(self, frame_hw: tuple[int, int]) -> int:
        h, w = self.visual_grid(frame_hw)
        return h * w

    def prepare(self, frames: np.ndarray, layout: StreamLayout | None) -> dict:
        return self._process(frames)

    @torch.inference_mode()
    def visual_embeds(self, frames: np.ndarray, inputs: dict | None = None) -> torch.Tensor:
        inputs = inputs or self.prepare(frames, None)
        out = self.model.model.get_video_features(
            inputs["pixel_values_videos"].to(self.device, self.dtype, non_blocking=True),
            inputs["video_grid_thw"].to(self.device, non_blocking=True),
            return_dict=True,
        )
        return torch.cat(out.pooler_output, dim=0).unsqueeze(0)

    @torch.inference_mode()
    def visual_chunk_scored(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """The chunk's tokens, and the attention each got in the tower's last block (a temporal
        step's patches among themselves), averaged over the patches the merger joins into it."""
        visual = self.model.model.visual
        attention = visual.blocks[-1].attn
        with layer_inputs(visual) as tower, layer_inputs(attention) as calls:
            embeds, extra = self.visual_chunk(frames, step_times, layout, inputs)
        patches = torch.cat([qwen_received(attention, *call) for call in calls])
        units = patches.view(-1, visual.spatial_merge_size**2).mean(dim=1)
        grids = torch.cat([kwargs.get("grid_thw", *args[1:2]) for args, kwargs in tower])
        return embeds, extra, self._merged_order(units, grids).view(len(step_times), -1)

    def _merged_order(self, units: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged units as the tower's blocks saw them, in the order its output gives them."""
        return units

    def _rope_kwargs(self, step_times: list[tuple[float, float]]) -> dict:
        if self.family == "qwen2_5_vl":  # temporal positions follow real time in 2.5-VL
            starts = [t[0] for t in step_times]
            seconds = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else 1.0
            return {"second_per_grid_ts": torch.tensor([seconds or 1.0])}
        return {}

    def stream_layout(
        self,
        frame_hw: tuple[int, int],
        step_times: list[tuple[float, float]],
        clip_frames: int | None = None,
    ) -> StreamLayout:
        # Ask the model itself for the M-RoPE positions of [prefix | video | suffix | one text
        # token]: the extra token gives the question's first position, which is not len +
        # rope_deltas.
        steps = len(step_times)
        h, w = self.visual_grid(frame_hw)
        merge = self.video_processor.merge_size
        video_id = self.model.config.video_token_id
        prefix, suffix = self.text_ids(self.prompt.prefix), self.text_ids(self.prompt.suffix_text)
        n_visual = steps * h * w
        ids = torch.tensor([prefix + [video_id] * n_visual + suffix + [prefix[0]]])
        mm_types = (ids == video_id).int() * 2
        grid = torch.tensor([[steps, h * merge, w * merge]])
        pos, _ = self.model.model.get_rope_index(
            ids, mm_token_type_ids=mm_types, video_grid_thw=grid, **self._rope_kwargs(step_times)
        )
        pos = pos[:, 0]
        a, b = len(prefix), len(prefix) + n_visual
        next_position = int(pos[0, -1])
        return StreamLayout(
            prefix=pos[:, :a],
            visual=pos[:, a:b],
            suffix=pos[:, b:-1],
            next_position=next_position,
            rope_delta=next_position - (pos.shape[1] - 1),
            step_lengths=[h * w] * steps,
            grid=(h, w),
        )


class Qwen25VLBackbone(QwenVLBackbone):
    family = "qwen2_5_vl"

    def _merged_order(self, units: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # the 2.5 tower runs its blocks over merged units grouped by attention window, and puts
        # them back in raster order after the merger
        visual = self.model.model.visual
        window, _ = get_vision_window_index(
            grid_thw, visual.spatial_merge_size, visual.window_size, visual.patch_size
        )
        return units[torch.argsort(window.to(units.device))]
