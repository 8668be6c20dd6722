"""A live stream's layout grows by its new steps alone where the family's positions are a left to
right scan (1-D RoPE, Qwen3-VL's timestamped frames), and equals the layout made whole at every
length; elsewhere it is made whole."""

from __future__ import annotations

import pytest
import torch

from mmkv_cli.backbones.layouts import extend_layout


def same(a, b) -> None:
    for part in ("prefix", "visual", "suffix"):
        assert torch.equal(getattr(a, part), getattr(b, part)), part
    assert (a.next_position, a.rope_delta, a.step_lengths, a.grid) == (
        b.next_position,
        b.rope_delta,
        b.step_lengths,
        b.grid,
    )
    assert (a.resize_to, a.offsets()) == (b.resize_to, b.offsets())


@pytest.mark.parametrize(
    "model", ["tiny-llava-ov", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
)
def test_a_grown_layout_is_the_layout_made_whole(backbones, model):
    backbone = backbones[model]
    times = [(0.5 * i, 0.5 * i + 0.25) for i in range(40)]  # 9.75 s: Qwen3's stamps grow a digit
    hw, clip = (64, 96), backbone.spec.max_frames
    grown = None
    for steps in (1, 2, 3, 7, 8, 20, 21, 40, 40):
        grown = extend_layout(backbone, grown, hw, times[:steps], clip)
        same(grown, backbone.stream_layout(hw, times[:steps], clip))
    assert grown.visual.shape[1] == sum(grown.step_lengths)


def test_a_family_that_scans_lays_out_only_the_new_steps(backbones, monkeypatch):
    backbone = backbones["tiny-qwen3-vl"]
    times = [(float(i), float(i)) for i in range(30)]
    base = backbone.stream_layout((64, 96), times[:29], backbone.spec.max_frames)
    asked = []
    real = type(backbone).stream_layout

    def counted(self, frame_hw, step_times, clip_frames=None):
        asked.append(len(step_times))
        return real(self, frame_hw, step_times, clip_frames)

    monkeypatch.setattr(type(backbone), "stream_layout", counted)
    extend_layout(backbone, base, (64, 96), times, backbone.spec.max_frames)
    assert asked == [1]
