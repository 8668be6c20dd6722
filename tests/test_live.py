"""A live stream's memory at moment T is the memory of the media cut at T: every method (streaming
and blockwise), every family, at a chunk's end and inside a chunk, while the stream goes on."""

from dataclasses import replace

import pytest
import torch

from mmkv_cli.core.errors import MediaError, UsageError
from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.encode.live import LiveEncoder
from mmkv_cli.media import load_media
from mmkv_cli.media.base import Media
from mmkv_cli.methods import METHODS, EncodeContext
from mmkv_cli.methods.choice import check_live, resolve_method
from tests.conftest import SAMPLES, TINY

EVERY = sorted(METHODS)


def cut(media: Media, frames: int) -> Media:
    """The media as it was when its first `frames` frames had come."""
    return Media(
        media.kind,
        media.source,
        media.digest,
        media.timestamps[:frames],
        lambda start, stop: media.read(start, min(stop, frames)),
    )


def live_choice(method: str, chunk_frames: int = 4):
    choice = resolve_method(method)
    if choice.method.takes_budget and choice.method.blockwise is None:  # a fixed memory
        choice = choice.with_budget(tokens=40)
    return replace(choice, params=replace(choice.params, chunk_frames=chunk_frames))


def assert_same_spans(got, want):
    assert got.layout == want.layout and got.visual_tokens_total == want.visual_tokens_total
    assert [b.name for b in got.blocks] == [b.name for b in want.blocks]
    for a, b in zip(
        [got.prefix, got.suffix, *got.blocks], [want.prefix, want.suffix, *want.blocks]
    ):
        assert (a.granularity, a.steps, a.time) == (b.granularity, b.steps, b.time), a.name
        for x, y in zip(a.keys + a.values + a.positions, b.keys + b.values + b.positions):
            assert x.shape == y.shape, a.name  # the same tokens kept
            assert torch.allclose(x.float(), y.float(), atol=1e-5), a.name
        assert (a.embeddings is None) == (b.embeddings is None), a.name  # SAVEMem's, as taken in
        if a.embeddings is not None:
            assert torch.allclose(a.embeddings.float(), b.embeddings.float(), atol=1e-3), a.name


def follow(backbone, method: str, moments: tuple[int, ...], reduce: str | None = None):
    """Push the sample clip frame by frame; at each moment (frames in), the live memory and the
    encode of the clip cut there."""
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=64)
    choice = live_choice(method).with_reduce(reduce)
    live = LiveEncoder(backbone, choice, EncodeContext("video"))
    frames = media.read(0, media.num_frames)
    for i, at in enumerate(media.timestamps):
        live.push(frames[i], at)
        if i + 1 in moments:
            want = encode_media(
                backbone,
                cut(media, i + 1),
                choice,
                EncodeContext("video"),
                clip_frames=backbone.spec.max_frames,
            )
            yield live.memory(), want
    yield (
        live.close(),
        encode_media(
            backbone, media, choice, EncodeContext("video"), clip_frames=backbone.spec.max_frames
        ),
    )


@pytest.mark.parametrize("method", EVERY)
def test_every_method_holds_live_what_the_cut_media_holds(backbones, method):
    for got, want in follow(backbones["tiny-qwen2.5-vl"], method, (4, 7)):
        assert_same_spans(got, want)


@pytest.mark.parametrize(
    ("method", "reduce"), [("hermes", "dtd"), ("mukv", "dtd"), ("full", "ctr")]
)
def test_a_reducer_holds_live_what_the_cut_media_holds(backbones, method, reduce):
    for got, want in follow(backbones["tiny-qwen3-vl"], method, (4, 7), reduce):
        assert_same_spans(got, want)
        assert got.stats["visual_tokens_prefilled"] == want.stats["visual_tokens_prefilled"]


@pytest.mark.parametrize("family", TINY)
def test_every_family_holds_live_what_the_cut_media_holds(backbones, family):
    for method in ("hermes", "infinipot", "mukv"):
        for got, want in follow(backbones[family], method, (5, 8)):
            assert_same_spans(got, want)


def test_per_head_infinipot_holds_live_what_the_cut_media_holds():
    """The trained demo's KV heads keep different tokens (issue 72): a live memory held per head,
    chunks attending to what each head holds, equals the encode of the clip cut there."""
    from mmkv_cli.api import PROCESS_BACKBONES
    from mmkv_cli.core.options import LoadOptions

    demo = PROCESS_BACKBONES.get(LoadOptions("demo", "cpu"))
    held = []
    for got, want in follow(demo, "infinipot", (12, 20)):
        assert_same_spans(got, want)
        held.append(got.per_head and want.per_head)
    assert all(held)


def test_a_share_of_an_unknown_length_is_refused_before_any_work():
    with pytest.raises(UsageError, match="--budget-tokens"):
        check_live(resolve_method("recency"))
    with pytest.raises(UsageError, match="share of each block"):
        check_live(resolve_method("mukv").with_budget(tokens=40))
    assert check_live(resolve_method("mukv")).name == "mukv"
    assert check_live(resolve_method("recency").with_budget(tokens=8)).budget.tokens == 8
    assert check_live(resolve_method("full")).name == "full"


def test_a_stream_that_changes_resolution_keeps_its_memory(backbones):
    live = LiveEncoder(backbones["tiny-llava-ov"], live_choice("recency"), EncodeContext("video"))
    frame = torch.zeros(32, 48, 3, dtype=torch.uint8).numpy()
    for i in range(5):
        live.push(frame, i * 0.5)
    with pytest.raises(MediaError, match="changed resolution at 2.50 s") as err:
        live.push(torch.zeros(40, 48, 3, dtype=torch.uint8).numpy(), 2.5)
    # `mmkv live` says where the memory so far is kept, once (issue 74, row 10)
    assert "memory so far" not in str(err.value)
    assert live.close().blocks  # what came before is still there


def test_a_fork_of_the_running_cache_shares_its_kv_and_never_changes_it():
    from transformers import DynamicCache

    from mmkv_cli.methods.running_cache import RunningCache

    cache = DynamicCache()
    keys = torch.arange(2 * 9 * 4, dtype=torch.float32).reshape(1, 2, 9, 4)
    cache.update(keys, -keys, 0)
    running = RunningCache(cache, prompt_len=2, position_dims=1)
    running.appended(torch.arange(7), torch.arange(10, 17)[None])
    running.offload(0, 3)  # into the archive
    before = [t.clone() for t in (*running.visual(0), running.index[0], running.positions[0])]
    fork = running.fork()
    assert fork.visual(0)[0].data_ptr() == running.visual(0)[0].data_ptr()  # no copy of the KV
    fork.cache.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), 0)  # a forward on the fork
    fork.appended(torch.arange(7, 9), torch.arange(17, 19)[None])
    fork.retain(0, torch.tensor([0, 2, 5]))
    fork.offload(0, 2)
    fork.replace(0, keys=torch.zeros(2, 1, 4))
    taken = fork.take_all_held()[0]
    assert taken[3].tolist() == [0, 1, 2, 3, 5, 8]  # the fork's own view of the stream
    after = (*running.visual(0), running.index[0], running.positions[0])
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the stream is as it was
    assert len(running.archive[0]) == 3 and running.count(0) == 4 and running.streamed == 7
