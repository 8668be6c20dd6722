"""SAVEMem: its importance, the long term's choice by importance and the memory cap written out
plainly in float64 from the definitions (the authors' SaveMem class), against mmkv's functions;
the whole memory over a real encode against the plain loop (FluxMem's tiers with the scene cut, the
protected direct drop, the choice by importance and the cap); the recency gate."""

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext, savemem
from tests.conftest import SAMPLES
from tests.helpers import choose, watched, with_policy
from tests.test_fluxmem import plain_best, plain_merge, plain_otsu, unit

GRID = (4, 4)


def plain_important(kept, scores, grid):
    """The kept tokens' share by importance: n kept, r = 0.15 + 0.25 x mean importance in [0, 1],
    max(4, int(n r)) in all; a quarter (at least one) the best of each quadrant around the kept
    tokens' centre, the rest the best left; all of them where n <= 4 or that is no fewer."""
    rows, cols = grid
    members = [t for t in range(rows * cols) if kept[t]]
    n = len(members)
    mean = sum(float(scores[t]) for t in members) / n
    total = max(4, int(n * (0.15 + 0.25 * min(1.0, max(0.0, mean)))))
    if n <= 4 or total >= n:
        return set(members)
    hs = [t // cols for t in members]
    ws = [t % cols for t in members]
    h_mid, w_mid = (min(hs) + max(hs)) / 2, (min(ws) + max(ws)) / 2
    chosen = set()
    for q in range(4):
        region = [t for t in members if ((t // cols > h_mid) * 2 + (t % cols > w_mid)) == q]
        region.sort(key=lambda t: -float(scores[t]))
        chosen |= set(region[: max(1, total // 4)])
    rest = sorted((t for t in members if t not in chosen), key=lambda t: -float(scores[t]))
    return chosen | set(rest[: total - len(chosen)])


@pytest.mark.parametrize("seed", range(5))
def test_the_long_term_by_importance_is_the_definition(seed):
    torch.manual_seed(seed)
    kept = torch.rand(16) > 0.2
    scores = torch.rand(16, dtype=torch.float64) * 1.2 - 0.1
    ours = savemem.most_important(kept, scores, GRID)
    assert set(ours.nonzero()[:, 0].tolist()) == plain_important(kept.tolist(), scores, GRID)


def test_importance_is_the_best_cosine_with_any_question_token():
    torch.manual_seed(3)
    x, q = torch.randn(5, 8, dtype=torch.float64), torch.randn(7, 8, dtype=torch.float64)
    want = [max(float(unit(x)[t] @ unit(q)[j]) for j in range(7)) for t in range(5)]
    assert savemem.importance(unit(x), unit(q)).tolist() == pytest.approx(want)


def test_the_cap_drops_the_least_important_alive_tokens():
    alive = torch.tensor([[True, False, True], [True, True, False]])
    scores = torch.tensor([[0.5, 0.0, 0.1], [0.3, 0.9, 0.05]])
    assert savemem.over_the_cap(alive, scores, torch.tensor(2)).tolist() == [
        [False, False, True],
        [True, False, False],
    ]
    assert not savemem.over_the_cap(alive, scores, torch.tensor(0)).any()


Watched = watched(savemem.SaveMemMemory)


def plain_memory(frames, questions, params, grid, short, mid):
    """SAVEMem's loop over frames [(stream indices, embeddings)]: the indices kept."""
    semantic = [(unit(x) @ questions.T).amax(dim=1) for _, x in frames]
    previous, means, scene = {}, [], {}
    keep_of, long_term = {}, []
    for f, (_, x) in enumerate(frames):
        if f:
            previous[f] = 1 - plain_best(x, frames[f - 1][1], grid)
            mean = float(previous[f].mean())
            running = sum(means) / len(means) if means else 0.0
            scene[f] = bool(means) and running > 1e-6 and mean > params.scene_change * running
            means.append(mean)
        leaving = f - short
        if leaving < 0:
            continue
        similar = plain_best(frames[leaving][1], frames[leaving + 1][1], grid)
        to_next = plain_otsu(1 - similar, True)
        to_previous = plain_otsu(previous[leaving], True) if leaving in previous else None
        keep = []
        for t, s in enumerate(similar.tolist()):
            p = float(previous[leaving][t]) if leaving in previous else -1
            stays = (1 - s) >= to_next or (to_previous is not None and p >= to_previous)
            protected = params.direct_drop_similarity + float(semantic[leaving][t]) * 0.15
            if not scene.get(leaving, False) and s > protected:
                stays = False
            keep.append(stays)
        keep_of[leaving] = keep
        old = leaving - mid
        if old < 0:
            continue
        if sum(keep_of[old]) >= params.semantic_long_term:
            chosen = plain_important(keep_of[old], semantic[old], grid)
        else:
            _, _, dropped = plain_merge(frames[old][1], keep_of[old], grid)
            chosen = {t for t, k in enumerate(keep_of[old]) if k} - dropped
        keep_of[old] = [t in chosen for t in range(len(keep_of[old]))]
        long_term.append(old)
        held = sum(sum(keep_of[g]) for g in long_term) + sum(
            sum(keep_of[g]) for g in range(old + 1, leaving + 1)
        )
        overflow = held - params.max_memory_tokens
        alive = [(float(semantic[g][t]), g, t) for g in long_term for t in range(len(keep_of[g]))
                 if keep_of[g][t]]  # fmt: skip
        for _, g, t in sorted(alive, key=lambda a: a[0])[: max(0, overflow)]:
            keep_of[g][t] = False
    kept = []
    for f, (index, _) in enumerate(frames):
        kept += [int(i) for t, i in enumerate(index) if keep_of.get(f, [True] * len(index))[t]]
    return sorted(kept)


# by importance (a frame keeps 6 or more) under a loose cap; merged (never 17) under a tight one
@pytest.mark.parametrize(("by_importance", "cap"), [(6, 40), (17, 12)])
@pytest.mark.parametrize("chunk_frames", [64, 4])
def test_the_memory_keeps_what_the_definition_keeps(backbones, chunk_frames, by_importance, cap):
    backbone = backbones["tiny-llava-ov"]  # one frame a step, a 4 x 4 grid
    choice = choose("savemem", chunk_frames=chunk_frames, short_term_frames=3, mid_term_frames=3,
                    semantic_long_term=by_importance, max_memory_tokens=cap)  # fmt: skip
    watched = Watched(choice.params, choice.budget, EncodeContext("video"))
    # no two frames alike: a still frame's choices are rounding's, in any precision
    media = load_media(str(SAMPLES / "clip.mp4"), fps=2.0, max_frames=16)
    encode_media(backbone, media, with_policy(choice, watched))
    asked = choice.params.pseudo_questions
    with torch.no_grad():
        tokens = [backbone.embed_ids(backbone.text_ids(q))[0] for q in asked]
    questions = unit(torch.cat(tokens).double())
    grid = backbone.stream_layout((64, 64), [(0.0, 0.0)]).grid
    want = plain_memory(watched.frames, questions, choice.params, grid, 3, 3)
    assert watched.kept == want


def test_the_gate_closed_keeps_the_short_term_alone(backbones):
    backbone = backbones["tiny-llava-ov"]
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=20)
    closed = encode_media(backbone, media, choose("savemem", gate_drop_ratio=0.1,
                                                  short_term_frames=3))  # fmt: skip
    assert [b.steps for b in closed.blocks] == [(17, 18), (18, 19), (19, 20)]
    opened = encode_media(backbone, media, choose("savemem", short_term_frames=3))
    assert len(opened.blocks) > 3
