"""Qwen3-VL: every temporal step is "<t seconds><|vision_start|> tokens <|vision_end|>", and
DeepStack adds vision features from several ViT depths to the first LM layers' hidden states at the
visual positions.

Its video processor bounds the pixels of a whole call, so a chunk alone would be resized differently
from the clip: the layout fixes the clip's size once and every chunk is resized to it before
processing.
"""

from __future__ import annotations

import numpy as np
import torch

from mmkv_cli.backbones.base import PromptPieces, StreamLayout
from mmkv_cli.backbones.qwen_vl import QwenVLBackbone

PROMPT = PromptPieces(
    prefix="<|im_start|>user\n",
    suffix_text="",
    question="{question}<|im_end|>\n<|im_start|>assistant\n",
)


class Qwen3VLBackbone(QwenVLBackbone):
    family = "qwen3_vl"
    positions_scan = True  # each frame behind its own timestamp, laid out in turn

    def _token(self, name: str) -> int:
        return int(getattr(self.model.config, name))

    def step_markers(self, time: tuple[float, float]) -> tuple[list[int], list[int]]:
        """Text before and after one step's visual tokens; the time is the middle of the step, as
        Qwen3 writes it."""
        stamp = self.text_ids(f"<{(time[0] + time[1]) / 2:.1f} seconds>")
        return stamp + [self._token("vision_start_token_id")], [self._token("vision_end_token_id")]

    def clip_size(self, frame_hw: tuple[int, int], num_frames: int) -> tuple[int, int]:
        """The pixel size the processor gives frames of this size in a clip of num_frames."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        proc = self.video_processor
        factor = proc.patch_size * proc.merge_size
        max_pixels = proc.size.longest_edge
        if proc.cap_pixels_per_frame:  # the processor's own per-frame cap, same rule
            per_frame = max(
                min(proc.max_video_tokens * factor * factor, max_pixels // num_frames),
                int(proc.size.shortest_edge * 1.05),
            )
            max_pixels = per_frame * num_frames
        return smart_resize(
            num_frames=max(num_frames, proc.temporal_patch_size),
            height=frame_hw[0],
            width=frame_hw[1],
            temporal_factor=proc.temporal_patch_size,
            factor=factor,
            min_pixels=proc.size.shortest_edge,
            max_pixels=max_pixels,
        )

    def _process_at(self, frames: np.ndarray, size: tuple[int, int]) -> dict:
        from transformers.image_utils import SizeDict
        from transformers.video_processing_utils import BaseVideoProcessor

        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).unsqueeze(0)
        if tuple(video.shape[-2:]) != tuple(size):
            video = BaseVideoProcessor.resize(
                self.video_processor,
                video,
                SizeDict(height=size[0], width=size[1]),
                resample=self.video_processor.resample,
            )
        frames = video[0].permute(0, 2, 3, 1).numpy()
        return self.video_processor(
            videos=[frames], return_tensors="pt", do_resize=False, do_sample_frames=False
        )

    def _grid_at(self, size: tuple[int, int]) -> tuple[int, int]:
        factor = self.video_processor.patch_size * self.video_processor.merge_size
        return size[0] // factor, size[1] // factor

    def stream_layout(
        self,
        frame_hw: tuple[int, int],
        step_times: list[tuple[float, float]],
        clip_frames: int | None = None,
    ) -> StreamLayout:
        size = self.clip_size(frame_hw, clip_frames or len(step_times) * self.frames_per_step)
        h, w = self._grid_at(size)
        video_id = self._token("video_token_id")
        ids, lengths, offsets = self.text_ids(self.prompt.prefix), [], []
        n_prefix = len(ids)
        for time in step_times:
            before, after = self.step_markers(time)
            ids += before + [video_id] * (h * w) + after
            lengths.append(len(before) + h * w + len(after))
            offsets.append(len(before))
        suffix = self.text_ids(self.prompt.suffix_text)
        ids = torch.tensor([ids + suffix + ids[:1]])
        merge = self.video_processor.merge_size
        grid = torch.tensor([[len(step_times), h * merge, w * merge]])
        pos, _ = self.model.model.get_rope_index(
            ids, mm_token_type_ids=(ids == video_id).int() * 2, video_grid_thw=grid
        )
        pos = pos[:, 0]
        end = n_prefix + sum(lengths)
        next_position = int(pos[0, -1])
        return StreamLayout(
            prefix=pos[:, :n_prefix],
            visual=pos[:, n_prefix:end],
            suffix=pos[:, end:-1],
            next_position=next_position,
            rope_delta=next_position - (pos.shape[1] - 1),
            step_lengths=lengths,
            grid=(h, w),
            resize_to=size,
            grid_offsets=offsets,
        )

    def prepare(self, frames: np.ndarray, layout: StreamLayout | None) -> dict:
        if layout is None:
            raise ValueError("Qwen3-VL sizes frames by the stream's layout")
        return self._process_at(frames, layout.resize_to)

    @torch.inference_mode()
    def visual_chunk(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict]:
        inputs = inputs or self.prepare(frames, layout)
        out = self.model.model.get_video_features(
            inputs["pixel_values_videos"].to(self.device, self.dtype, non_blocking=True),
            inputs["video_grid_thw"].to(self.device, non_blocking=True),
            return_dict=True,
        )
        visual = torch.cat(out.pooler_output, dim=0)
        deep = [torch.cat(level, dim=0) for level in out.deepstack_features]
        per_step = visual.shape[0] // len(step_times)
        pieces, is_visual = [], []
        for step, time in enumerate(step_times):
            before, after = self.step_markers(time)
            pieces += [
                self.embed_ids(before)[0],
                visual[step * per_step : (step + 1) * per_step],
                self.embed_ids(after)[0],
            ]
            is_visual += [False] * len(before) + [True] * per_step + [False] * len(after)
        mask = torch.tensor([is_visual], device=self.device)
        embeds = torch.cat(pieces, dim=0).unsqueeze(0).to(self.dtype)
        return embeds, {"visual_pos_masks": mask, "deepstack_visual_embeds": deep}

    def select_extra(self, extra: dict, index: torch.Tensor) -> dict:
        # DeepStack rows follow the visual tokens in order; a batch reads them row-major, as the
        # model does.
        mask = extra["visual_pos_masks"][0]
        rank = torch.cumsum(mask.long(), 0) - 1
        index = index.to(mask.device)
        chosen = mask[index]
        if not bool(chosen.any()):
            return {}
        rows = rank[index][chosen]
        return {
            "visual_pos_masks": chosen,
            "deepstack_visual_embeds": [d[rows] for d in extra["deepstack_visual_embeds"]],
        }

    def visual_embeds(self, frames: np.ndarray, inputs: dict | None = None) -> torch.Tensor:
        raise NotImplementedError("Qwen3-VL interleaves markers with frames: use visual_chunk")
