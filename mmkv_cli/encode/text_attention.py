"""What a text pays the cached visual tokens of a running encode: the seam through which streaming
policies score by a prompt (`StreamState.attend`), the text run as a question turn after the stream
so far and cut off the cache again."""

from __future__ import annotations

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.kernels.attention import Recorder, recording
from mmkv_cli.kernels.host import host_all
from mmkv_cli.methods.running_cache import StreamState


def text_attention(
    backbone: Backbone,
    state: StreamState,
    text: str | list[str],
    rows: bool = False,
    reducers: dict | None = None,
    per_head: bool = False,
):
    """Per layer, the attention the rows of `text` (as a question turn after the stream so far) pay
    each cached visual token, mean over heads and rows; the text is cut off the cache again
    afterwards. A list of texts: one forward each and one copy to the host for all of them, a list
    of per-layer results (HERMES' role questions: one wait a compression, not one a question).

    rows=True: per layer the text rows' attention over all keys [q, k], with the key columns of the
    cached visual tokens and of the text, as (rows, visual slices, text slices).
    reducers (name -> fn(block [B, H, rows, visual columns])): per layer, each reducer's mean over
    the text rows, every head kept (MEDA's per-head entropy); nothing [H, q, k] is held whole.
    per_head: per layer [H_kv, visual] instead, each KV head's mean over its query heads (what a
    method keeping tokens per KV head scores by).
    """
    if not isinstance(text, str):
        if rows or reducers:
            raise ValueError("several texts are scored by their column sums only")
        sums = [_on_device(backbone, state, t, False, None, per_head)[0] for t in text]
        flat = host_all([s for each in sums for s in each])
        return [flat[i * state.layers : (i + 1) * state.layers] for i in range(len(text))]
    found, recorder, visual, ends, count = _on_device(
        backbone, state, text, rows, reducers, per_head
    )
    # every layer's share brought over in one copy: a copy a layer waited once a layer
    if reducers:
        names = list(reducers)
        totals = host_all(
            [recorder.reduced[layer][n][0] for layer in range(state.layers) for n in names]
        )
        return [
            {n: totals[layer * len(names) + i] / count for i, n in enumerate(names)}
            for layer in range(state.layers)
        ]
    if rows:
        return (
            host_all([recorder.row[layer][0] for layer in range(state.layers)]),
            visual,
            [slice(n, n + count) for n in ends],
        )
    return host_all(found)


def _on_device(
    backbone: Backbone, state: StreamState, text: str, rows: bool, reducers, per_head: bool = False
):
    """The text's forward over the running cache, recorded: (per layer its mean column sums over
    the visual tokens, still on the device; the recorder; the visual slices; the cache ends; the
    text's token count)."""
    ids = backbone.question_ids(text)
    last_step = state.token_step[: state.seen] == state.token_step[state.seen - 1]
    start = int(state.placed(0, state.seen)[:, last_step].max()) + 1  # right after the newest step
    ends = [int(e.keys.shape[2]) for e in state.cache.cache.layers]
    starts = [state.cache.visual_start(layer) for layer in range(state.layers)]
    visual = [slice(s, n) for s, n in zip(starts, ends)]
    recorder = Recorder(
        layers=set(range(state.layers)),
        column_sums=not rows and not reducers,
        per_head=per_head,
        rows=rows,
        reducers={name: (dict(enumerate(visual)), fn) for name, fn in (reducers or {}).items()},
    )
    with state.cache.scratch(), recording(recorder):
        positions = backbone.text_positions(start, len(ids))
        backbone.forward(backbone.embed_ids(ids), positions, state.cache.cache)
    sums = []
    if not rows and not reducers:
        sums = [
            recorder.column_sum[layer][0, ..., starts[layer] : ends[layer]] / len(ids)
            for layer in range(state.layers)
        ]
    return sums, recorder, visual, ends, len(ids)
