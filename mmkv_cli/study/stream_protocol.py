"""The stream protocol of `mmkv eval`: a clip is encoded once, as a live stream, and each question
is answered when the stream reaches its moment, from the memory the method holds then (OVO-Bench's
real-time questions, RVS-style streaming evaluation). The replay protocol instead encodes the whole
clip and asks with `--at`, which for a method that evicts while streaming is a memory shaped by
frames after the moment."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

from mmkv_cli import api
from mmkv_cli.core.options import AskOptions
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.encode.record import write_encoded
from mmkv_cli.media import Media, load_media
from mmkv_cli.methods import EncodeContext
from mmkv_cli.methods.choice import MethodChoice
from mmkv_cli.pack import QuantSpec
from mmkv_cli.study.eval_sets.items import Item


def answered_live(
    video: str,
    items: list[Item],
    backbone,
    choice: MethodChoice,
    fps: float,
    max_frames: int,
    kv_bits: int,
    asking: AskOptions,
    prompt_for,
) -> Iterator[tuple[Item, object, dict]]:
    """(item, answer, the inspect view of the memory it was answered from) for each item, the
    clip streamed once: an item with a moment is answered before the first frame after it, the
    others from the memory at the clip's end."""
    media = load_media(video, fps=fps, max_frames=max_frames)
    context = EncodeContext(media.kind)
    live = LiveEncoder(backbone, choice, context)
    waiting = sorted(items, key=lambda i: (i.at is None, i.at or 0.0))
    with tempfile.TemporaryDirectory(prefix="mmkv-eval-stream-") as folder:
        pack = Path(folder) / "now.kvpack"

        def answer_due(due: list[Item]):
            frames = len(live.times)
            cut = Media(media.kind, media.source, media.digest, media.timestamps[:frames], None)
            encoded = live.memory()
            write_encoded(pack, backbone, choice, context, cut, encoded, QuantSpec(kv_bits), True)
            info = api.inspect(pack)
            for item in due:
                yield item, api.ask(pack, prompt_for(item), asking, backbone=backbone), info

        for index, at in enumerate(media.timestamps):
            due = [i for i in waiting if i.at is not None and i.at < at]
            if due and live.times:
                waiting = waiting[len(due) :]
                yield from answer_due(due)
            live.push(media.read(index, index + 1)[0], at)
        if waiting:
            yield from answer_due(waiting)
