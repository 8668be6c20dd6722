"""Token reducers: their scoring on tensors written from the authors' definitions, and the seam
end to end (kept tokens keep their places, dropped ones are never prefilled, refusals before any
work)."""

import pytest
import torch

from mmkv_cli.core.errors import UsageError
from mmkv_cli.encode.reducing import grid_index
from mmkv_cli.media import load_media
from mmkv_cli.pack import PackReader
from mmkv_cli.reduce import REDUCERS, StepTokens, ctr, dtd, visionzip
from mmkv_cli.reduce.base import similarity_to_previous
from mmkv_cli.reduce.choice import check_reducer, resolve_reducer
from tests.conftest import SAMPLES
from tests.helpers import ask_pack, encode_pack
from tests.test_cli import mmkv


def tokens(grid, previous=None, importance=None):
    return StepTokens(grid.float(), previous, importance)


# --- DTD ---


def test_dtd_drops_what_barely_changed_against_the_whole_step_before():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    previous = torch.stack([a, a, a, a])
    step1 = torch.stack([a, a, b, b])  # places 2, 3 changed
    step2 = torch.stack([a, b, b, a])  # against step1 whole: places 1 and 3 changed
    out = dtd.reduce(dtd.DTDParams(0.5), tokens(torch.stack([step1, step2]), previous))
    assert out.keep.tolist() == [[False, False, True, True], [False, True, False, True]]
    assert torch.equal(out.grid, torch.stack([step1, step2]))  # nothing merged
    first = dtd.reduce(dtd.DTDParams(0.5), tokens(step1[None]))  # the stream's first step
    assert first.keep.all()


def test_dtd_threshold_one_keeps_every_token():
    grid = torch.randn(3, 4, 8)
    grid[1] = grid[0]
    assert dtd.reduce(dtd.DTDParams(1.0), tokens(grid, grid[0])).keep.all()
    sims = similarity_to_previous(grid, None)
    assert sims[0].isneginf().all() and torch.allclose(sims[1], torch.ones(4))


# --- CTR ---


def test_ctr_splits_its_budget_as_the_authors_round_it():
    static = torch.tensor([98, 10, 190, 0, 196])
    keep_static, keep_dynamic = ctr.split_budget(50, static, 196)  # every step's at once
    assert keep_static.tolist() == [25, 2, 48, 0, 50]  # the static part rounded down
    assert keep_dynamic.tolist() == [25, 48, 2, 50, 0]
    assert ctr.split_budget(4, torch.tensor([1]), 5) == (torch.tensor([0]), torch.tensor([4]))
    assert ctr.split_budget(4, torch.tensor([4]), 5) == (torch.tensor([3]), torch.tensor([1]))
    assert ctr.retained(ctr.CTRParams(), 196) == 50 and ctr.retained(ctr.CTRParams(), 16) == 4


def test_density_peaks_find_one_centre_in_each_cluster():
    torch.manual_seed(0)
    left = torch.randn(6, 4) * 0.01
    right = torch.randn(5, 4) * 0.01 + 5
    points = torch.cat([left, right])[None]
    static = torch.ones(1, 11, dtype=torch.bool)
    centres = ctr.density_peaks(ctr.distances(points), static, torch.tensor([2]), k=3)[0]
    assert centres[:6].sum() == 1 and centres[6:].sum() == 1


def test_density_peaks_choose_among_the_static_tokens_only():
    """A moving token between two static clusters is never a centre, nor anyone's neighbour; a
    step with no more static tokens than its count keeps them all, one with none keeps none."""
    torch.manual_seed(0)
    points = torch.cat([torch.randn(4, 4) * 0.01, torch.full((1, 4), 2.5),
                        torch.randn(4, 4) * 0.01 + 5])  # fmt: skip
    static = torch.ones(3, 9, dtype=torch.bool)
    static[0, 4] = False
    static[1, :7] = False
    static[2] = False
    grid = points.expand(3, -1, -1)
    others = grid[:1, [0, 1, 2, 3, 5, 6, 7, 8]]  # the step without its moving token
    every = torch.ones(1, 8, dtype=torch.bool)
    alone = ctr.density_peaks(ctr.distances(others), every, torch.tensor([2]), k=3)
    centres = ctr.density_peaks(ctr.distances(grid), static, torch.tensor([2, 2, 0]), k=3)
    assert centres[0].tolist() == [*alone[0, :4].tolist(), False, *alone[0, 4:].tolist()]
    assert centres[1].tolist() == [False] * 7 + [True, True] and not centres[2].any()


def test_a_static_centre_becomes_beta_itself_plus_the_rest_its_members_mean():
    points = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [10.0, 10.0], [11.0, 10.0],
                           [5.0, 5.0]])[None]  # fmt: skip
    static = torch.tensor([[True, True, True, True, True, False]])  # the last one moves
    centres = torch.tensor([[True, False, False, True, False, False]])
    merged = ctr.merge_into_centres(points, ctr.distances(points), static, centres, beta=0.6)[0]
    assert torch.allclose(merged[0], 0.6 * points[0, 0] + 0.4 * points[0, 1:3].mean(0))
    assert torch.allclose(merged[3], 0.6 * points[0, 3] + 0.4 * points[0, 4])
    assert torch.equal(merged[[1, 2, 4, 5]], points[0, [1, 2, 4, 5]])


def test_ctr_keeps_its_count_moving_tokens_by_attention_still_ones_merged():
    torch.manual_seed(1)
    previous = torch.randn(8, 6)
    step = previous.clone()
    step[4:] = torch.randn(4, 6)  # places 4-7 move
    importance = torch.tensor([[0.0, 0, 0, 0, 0.1, 0.9, 0.2, 0.8]])
    params = ctr.CTRParams(retain=0.5, beta=0.6)  # 4 of 8: 2 still, 2 moving
    out = ctr.reduce(params, tokens(step[None], previous, importance))
    kept = out.keep[0].nonzero()[:, 0].tolist()
    assert len(kept) == 4 and {5, 7} <= set(kept)  # the two moving tokens the tower looked at
    still = [i for i in kept if i < 4]
    assert len(still) == 2
    changed = [i for i in still if not torch.equal(out.grid[0, i], step[i])]
    assert changed  # a centre that others joined is their merge, at its own place
    assert torch.equal(out.grid[0, 4:], step[4:])  # moving tokens are kept as they are


# --- VisionZip ---


def test_visionzip_keeps_the_dominant_tokens_and_merges_contextual_ones():
    grid = torch.tensor([[1.0, 0], [0, 1], [1, 0.1], [0.1, 1], [5, 5], [1, 0.2]])
    importance = torch.tensor([[0.0, 0, 0, 0, 1.0, 0]])
    params = visionzip.VisionZipParams(dominant=1 / 6, contextual=2 / 6)
    out = visionzip.reduce(params, tokens(grid[None], None, importance))
    assert out.keep[0].tolist() == [True, False, True, False, True, False]
    # targets at stride len(rest) // 2 = 2 over the rest [0, 1, 2, 3, 5]: 0 and 2
    rest = grid[[0, 1, 2, 3, 5]]
    unit = torch.nn.functional.normalize(rest, dim=-1)
    nearest = (unit[[1, 3, 4]] @ unit[[0, 2]].T).argmax(-1).tolist()
    members = {0: [], 1: []}
    for who, target in zip([1, 3, 4], nearest):
        members[target].append(rest[who])
    for target, slot in ((0, 0), (1, 2)):
        extra = torch.stack(members[target]).mean(0) if members[target] else torch.zeros(2)
        assert torch.allclose(out.grid[0, slot], rest[[0, 2][target]] + extra)
    mean = visionzip.reduce(
        visionzip.VisionZipParams(1 / 6, 2 / 6, "mean"), tokens(grid[None], None, importance)
    )
    assert mean.keep.equal(out.keep) and not torch.allclose(mean.grid, out.grid)


# --- the seam ---


def positions(reader: PackReader) -> list[int]:
    """The first layer's stored positions of every block, in order."""
    spans = [reader.span(reader.blocks.name(i)) for i in range(len(reader.blocks))]
    return [int(p) for span in spans for p in span.positions[0][0]]


def test_grid_index_skips_the_markers_between_steps():
    class Layout:
        step_lengths = [6, 6, 6]
        grid = (2, 2)

        def offsets(self):
            return [1, 1, 1]

    assert grid_index(Layout(), 1, 2).tolist() == [[1, 2, 3, 4], [7, 8, 9, 10]]


def test_a_reducer_that_keeps_everything_writes_the_same_pack(tmp_path, backbones):
    backbone = backbones["tiny-llava-ov"]
    plain = encode_pack(SAMPLES / "clip.mp4", tmp_path / "a.kvpack", backbone=backbone)
    same = tmp_path / "b.kvpack"
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "keep.yaml").write_text(
        "extends: full\nreduce: dtd\nreduce_params: {drop_threshold: 1.0}\n"
    )
    from mmkv_cli.presets import use_presets

    use_presets(tmp_path)
    try:
        info = encode_pack(SAMPLES / "clip.mp4", same, method="keep", backbone=backbone)
    finally:
        use_presets(None)
    assert (
        info["reduce"] == "dtd" and info["visual_tokens_prefilled"] == plain["visual_tokens_total"]
    )
    a, b = (
        ask_pack(p, "what shape?", backbone=backbone, keep_logits=True)
        for p in (tmp_path / "a.kvpack", same)
    )
    assert torch.allclose(a.first_logits, b.first_logits, atol=1e-5)


@pytest.mark.parametrize("name", ["dtd", "ctr", "visionzip"])
def test_kept_tokens_keep_the_places_they_had_in_the_whole_stream(tmp_path, backbones, name):
    backbone = backbones["tiny-llava-ov"]
    full = tmp_path / "full.kvpack"
    encode_pack(SAMPLES / "clip.mp4", full, backbone=backbone)
    cut = tmp_path / "cut.kvpack"
    info = encode_pack(SAMPLES / "clip.mp4", cut, backbone=backbone, reduce=name)
    assert 0 < info["visual_tokens_prefilled"] < info["visual_tokens_total"]
    assert info["visual_tokens_kept"] == info["visual_tokens_prefilled"]
    every = {int(p) for p in positions(PackReader(full))}
    reader = PackReader(cut)
    kept = positions(reader)
    assert len(kept) == info["visual_tokens_prefilled"] and set(kept) <= every
    assert reader.header.method.reduce["name"] == name


def test_a_dropping_reducer_prefills_fewer_tokens_than_the_stream(tmp_path, backbones):
    info = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "p.kvpack",
        backbone=backbones["tiny-llava-ov"],
        method="hermes",
        budget_tokens=24,
        reduce="dtd",
    )
    assert info["visual_tokens_prefilled"] < info["visual_tokens_total"]
    assert info["visual_tokens_kept"] <= 24


def test_reducers_it_cannot_serve_are_refused_in_one_line_before_any_work(tmp_path):
    out = tmp_path / "p.kvpack"
    for args, says in (
        (["--reduce", "dtd", str(SAMPLES / "doc.pdf")], "takes video, not pdf"),
        (["--reduce", "ctr", str(SAMPLES / "images")], "takes video, not images"),
        (["--reduce", "dtz", str(SAMPLES / "clip.mp4")], "did you mean 'dtd'"),
        (["--method", "streamingtom", str(SAMPLES / "doc.pdf")], "takes video, not pdf"),
    ):
        result = mmkv("encode", *args, "-o", str(out))
        assert result.returncode == 2, args
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, args
        assert not out.exists()


def test_a_preset_over_a_preset_overrides_its_reducer_parameters(tmp_path):
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.presets import use_presets

    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "a.yaml").write_text(
        "extends: streamingtom\nreduce_params: {retain: 0.5, beta: 0.2}\n"
    )
    (tmp_path / "methods" / "b.yaml").write_text("extends: a\nreduce_params: {k: 3}\n")
    (tmp_path / "methods" / "c.yaml").write_text("extends: a\nreduce: none\n")
    use_presets(tmp_path)
    try:
        b, c = resolve_method("b").reduce, resolve_method("c").reduce
    finally:
        use_presets(None)
    assert b.name == "ctr" and (b.params.retain, b.params.beta, b.params.k) == (0.5, 0.2, 3)
    assert c is None


def test_a_forged_prefilled_count_is_refused_on_open(tmp_path, backbones):
    from mmkv_cli import api
    from mmkv_cli.core.errors import PackError
    from tests.mutants import Parts

    pack = tmp_path / "p.kvpack"
    encode_pack(SAMPLES / "clip.mp4", pack, backbone=backbones["tiny-llava-ov"], reduce="dtd")
    for value in (10**9, -1, "many"):
        forged = tmp_path / "forged.kvpack"
        forged.write_bytes(
            Parts.with_header(pack, lambda h, v=value: h["stats"].update(visual_tokens_prefilled=v))
        )
        with pytest.raises(PackError, match="corrupted"):
            api.inspect(forged)


def test_a_preset_reducer_is_checked_against_its_types(tmp_path):
    with pytest.raises(UsageError, match="drop_threshold"):
        resolve_reducer("dtd", {"drop_threshold": 2.0})
    with pytest.raises(UsageError, match="unknown"):
        resolve_reducer("dtd", {"threshold": 0.5})
    with pytest.raises(UsageError, match="without a reducer"):
        resolve_reducer(None, {"drop_threshold": 0.5})
    assert resolve_reducer("none") is None
    check_reducer(resolve_reducer("visionzip"), "pdf", "llava_onevision", ["llava_onevision"])
    with pytest.raises(UsageError, match="adapter does not expose"):
        check_reducer(resolve_reducer("ctr"), "video", "a_new_family", ["llava_onevision"])


def test_every_reducer_is_typed_and_cited():
    for name, reducer in REDUCERS.items():
        assert reducer.name == name and reducer.paper.url.startswith("https://")
        reducer.params()  # every field has its default


# --- the tower's attention, as each family gives it ---


@pytest.mark.parametrize("family", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_a_qwen_tower_gives_each_token_the_attention_its_merged_patches_got(backbones, family):
    backbone = backbones[family]
    frames = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=4).read(0, 4)
    steps = [(0.0, 0.5), (1.0, 1.5)]
    layout = backbone.stream_layout(tuple(frames.shape[1:3]), steps)
    embeds, _, importance = backbone.visual_chunk_scored(frames, steps, layout)
    plain, _ = backbone.visual_chunk(frames, steps, layout)
    assert torch.equal(embeds, plain)  # reading the attention changes nothing
    assert importance.shape == (2, layout.grid[0] * layout.grid[1])
    # each step's patches attend among themselves: their shares sum to 1, a token averages 4
    assert torch.allclose(importance.sum(dim=1), torch.full((2,), 0.25), atol=1e-5)


def test_qwen25_puts_its_window_ordered_units_back_in_raster_order(backbones):
    from mmkv_cli.backbones.tower_attention import layer_inputs

    backbone = backbones["tiny-qwen2.5-vl"]
    visual = backbone.model.model.visual
    frames = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=4).read(0, 4)
    with layer_inputs(visual.merger) as merged, layer_inputs(visual) as tower:
        out = backbone.visual_embeds(frames)[0]
    with torch.inference_mode():
        in_window_order = visual.merger(*merged[0][0], **merged[0][1])
    grid = tower[0][1]["grid_thw"]
    assert not torch.allclose(in_window_order, out)  # the tiny tower's windows do permute
    assert torch.allclose(backbone._merged_order(in_window_order, grid), out)


def test_llava_ov_pools_the_patch_attention_to_the_token_grid(backbones):
    backbone = backbones["tiny-llava-ov"]
    frames = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=3).read(0, 3)
    steps = [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)]
    layout = backbone.stream_layout(tuple(frames.shape[1:3]), steps)
    embeds, _, importance = backbone.visual_chunk_scored(frames, steps, layout)
    assert torch.equal(embeds, backbone.visual_embeds(frames))
    assert importance.shape == (3, layout.grid[0] * layout.grid[1])
    assert bool((importance > 0).all()) and torch.isfinite(importance).all()
