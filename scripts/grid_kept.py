"""Where each method's budget goes on demo-grid: the share of kept visual tokens that show a shape.

    python scripts/grid_kept.py SET --seed S [--frames 64] [--kind mixed] [--methods snapkv,hermes]
        [--budget 0.1] [--clips 8]

SET is a folder `mmkv synth --world grid` wrote; its clips are rebuilt from their seeds to
know, frame by frame, which of a frame's 16 tokens each shape covers. Every clip is encoded with
each method into a pack, and the kept positions of every layer are read back from it. Printed per
method: the share of kept visual tokens on a shape ("fg"; the stream's own share is the base rate),
the share of frames that keep at least one token, when the kept tokens sit on average (0: the first
frame, 1: the last), and, on needle clips, the share of the needle's
tokens kept, averaged over layers. A method that finds the shapes keeps fg well above the base rate;
one that keeps whole recent frames sits at it. A method that compacts the positions it keeps (hermes
by default, `reindex: eager`) cannot be placed: its packs no longer say where a token came from.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmkv_cli import api  # noqa: E402
from mmkv_cli.backbones.loading import load_backbone  # noqa: E402
from mmkv_cli.core.options import EncodeOptions, LoadOptions  # noqa: E402
from mmkv_cli.pack import PackReader  # noqa: E402
from mmkv_cli.study.synth import grid, make_clip  # noqa: E402
from mmkv_cli.study.synth.world import NEEDLE  # noqa: E402

PER_FRAME = 16  # demo-grid: 4 x 4 tokens a frame


def shape_tokens(clip) -> tuple[np.ndarray, np.ndarray]:
    """[frames, 16] bools: tokens a shape covers; and those the needle (a one-off star) covers."""
    on = np.zeros((clip.frames, PER_FRAME), dtype=bool)
    needle = np.zeros_like(on)
    for event in clip.events:
        for f in range(event.start, min(event.stop, clip.frames)):
            cells = grid.covered_tokens(event, f)
            on[f, cells] = True
            if event.shape == NEEDLE and clip.kind == "needle":
                needle[f, cells] = True
    return on, needle


def kept_visual(pack: Path, frames: int) -> list[np.ndarray]:
    """Per layer, the visual token indices (frame * 16 + token) the pack holds."""
    reader = PackReader(pack)
    first = int(reader.span("prefix").positions[0].shape[1])  # visual tokens follow the prompt
    names = [reader.blocks.name(i) for i in range(len(reader.blocks))]
    _, _, positions = reader.gather(names)
    layers = []
    for pos in positions:
        index = pos[0].numpy() - first
        layers.append(np.unique(index[(index >= 0) & (index < frames * PER_FRAME)]))
    return layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("set", type=Path)
    ap.add_argument("--seed", type=int, required=True, help="the seed `mmkv synth` was given")
    ap.add_argument("--frames", type=int, default=64, help="the --frames `mmkv synth` was given")
    ap.add_argument("--kind", default="mixed", help="the --kind `mmkv synth` was given")
    ap.add_argument("--methods", default="recency,snapkv,pyramidkv,h2o,meda,aircache,infinipot")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--clips", type=int, default=8)
    args = ap.parse_args()
    rows = [json.loads(line) for line in (args.set / "qa.jsonl").read_text().splitlines()]
    videos = list(dict.fromkeys(r["video"] for r in rows))[: args.clips]
    kinds = {r["video"]: r["clip_kind"] for r in rows}
    backbone = load_backbone(LoadOptions("demo-grid", "cpu"))
    print(f"{'method':<12} {'fg':>6} {'base':>6} {'frames':>7} {'when':>6} {'needle':>7}")
    for method in args.methods.split(","):
        fg, base, touched, when, needles = [], [], [], [], []
        for video in videos:
            index = int(Path(video).stem.split("_")[-1])  # clips/clip_0007.mp4: the 8th clip
            clip, _ = make_clip(args.seed, index, args.frames, args.kind, "grid")
            if clip.kind != kinds[video]:
                sys.exit(f"{video} is not the clip `mmkv synth` made with these arguments")
            on, needle = shape_tokens(clip)
            with tempfile.TemporaryDirectory() as tmp:
                pack = Path(tmp) / "clip.kvpack"
                options = EncodeOptions(
                    method, budget=args.budget, max_frames=clip.frames, force=True
                )
                api.encode(str(args.set / video), pack, options, backbone=backbone)
                layers = kept_visual(pack, clip.frames)
            base.append(on.mean())
            for kept in layers:
                fg.append(on.reshape(-1)[kept].mean() if len(kept) else 0.0)
                touched.append(len(np.unique(kept // PER_FRAME)) / clip.frames)
                when.append((kept // PER_FRAME).mean() / (clip.frames - 1) if len(kept) else 0.5)
                if needle.any():
                    needles.append(np.isin(np.flatnonzero(needle), kept).mean())
        cell = f"{np.mean(needles):7.2f}" if needles else f"{'':>7}"
        print(
            f"{method:<12} {np.mean(fg):6.2f} {np.mean(base):6.2f} {np.mean(touched):7.2f} "
            f"{np.mean(when):6.2f} {cell}",
            flush=True,
        )


if __name__ == "__main__":
    main()
