"""FluxMem: its neighbourhood similarity, Otsu's threshold, the mid-term choice and the long-term
merge written out plainly in float64 from the definitions (the authors' FluxMem class), against
mmkv's functions on the same tensors; and the whole memory over a real encode against the plain
three-tier loop, anchors holding their parts' mean K and V."""

import math

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext, fluxmem, tiers
from tests.conftest import SAMPLES
from tests.helpers import choose, watched, with_policy

GRID = (3, 4)


def unit(x):
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-8)


def plain_best(query, other, grid):
    """Each token's best cosine over the 3x3 places around its own in `other`."""
    rows, cols = grid
    out = []
    for t in range(rows * cols):
        r, c = divmod(t, cols)
        around = [
            (r + dr) * cols + (c + dc)
            for dr in (-1, 0, 1)
            for dc in (-1, 0, 1)
            if 0 <= r + dr < rows and 0 <= c + dc < cols
        ]
        out.append(min(1.0, max(float(unit(query)[t] @ unit(other)[j]) for j in around)))
    return torch.tensor(out, dtype=torch.float64)


def plain_otsu(values, fallback):
    """Otsu over 128 bins of [0, 2]: the bin centre that best separates the values (between-class
    variance), or the lower median where they are alike or nothing separates them (with
    fallback), else None."""
    v = [min(2.0, max(0.0, float(x))) for x in values]
    if not v:
        return None
    lower_median = sorted(v)[(len(v) - 1) // 2]
    if fallback and len(v) > 1:
        mean = sum(v) / len(v)
        if sum((x - mean) ** 2 for x in v) / (len(v) - 1) <= 1e-12:
            return lower_median
    hist = [0] * 128
    for x in v:
        hist[min(127, int(x * 64))] += 1
    p = [h / len(v) for h in hist]
    best, best_value = None, 0.0
    omega = mu = 0.0
    mu_total = sum(p[i] * (i + 0.5) / 64 for i in range(128))
    for i in range(128):
        omega += p[i]
        mu += p[i] * (i + 0.5) / 64
        if omega < 1e-6 or 1 - omega < 1e-6:
            continue
        between = (mu_total * omega - mu) ** 2 / (omega * (1 - omega))
        if between > best_value + 1e-12:
            best, best_value = i, between
    if best is None:
        return lower_median if fallback else None
    return (best + 0.5) / 64


def test_the_neighbourhood_similarity_is_the_best_of_the_3x3_around():
    torch.manual_seed(1)
    query, other = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 5, dtype=torch.float64)
    near = tiers.neighbours(GRID, centre=True)
    ours = tiers.best_neighbour_similarity(unit(query), unit(other), near)
    assert torch.allclose(ours, plain_best(query, other, GRID), atol=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_otsu_is_the_definition(seed):
    torch.manual_seed(seed)
    values = torch.cat([torch.rand(20) * 0.3, 0.6 + torch.rand(12) * 0.5]).double()
    mask = torch.rand(32) > 0.2
    for fallback in (True, False):
        threshold, found = tiers.otsu(values, mask, fallback)
        want = plain_otsu(values[mask], fallback)
        assert bool(found) == (want is not None)
        assert want is None or float(threshold) == pytest.approx(want, abs=1e-9)


def test_otsu_falls_back_to_the_lower_median_where_values_are_alike():
    alike = torch.full((6,), 0.25, dtype=torch.float64)
    every = torch.ones(6, dtype=torch.bool)
    assert float(tiers.otsu(alike, every, True)[0]) == 0.25
    assert not bool(tiers.otsu(alike, every, False)[1])  # the merge then does nothing


def test_the_mid_term_keeps_what_differs_from_either_neighbour():
    torch.manual_seed(2)
    similar = torch.rand(12, dtype=torch.float64) * 0.95
    previous = torch.rand(12, dtype=torch.float64)
    params = fluxmem.FluxMemParams()
    ours = fluxmem.mid_term_keep(similar, previous, params)
    to_next = plain_otsu(1 - similar, True)
    to_previous = plain_otsu(previous, True)
    want = [
        ((1 - s) >= to_next or p >= to_previous) and not s > 0.8
        for s, p in zip(similar.tolist(), previous.tolist())
    ]
    assert ours.tolist() == want
    first = fluxmem.mid_term_keep(similar, None, params)  # the stream's first frame: next only
    assert first.tolist() == [(1 - s) >= to_next and not s > 0.8 for s in similar.tolist()]
    fixed = fluxmem.mid_term_keep(similar, previous, fluxmem.FluxMemParams(pair_similarity=0.5))
    assert fixed.tolist() == [
        ((1 - s) >= 0.5 or p >= 0.5) and not s > 0.8
        for s, p in zip(similar.tolist(), previous.tolist())
    ]


def plain_merge(x, kept, grid):
    """(part of each token, anchors, dropped): kept tokens joined by 8-neighbour edges (each pair
    once) no longer than Otsu's threshold of those edges; in each part of two or more, the member
    nearest the part's mean (the first of equals) stays."""
    rows, cols = grid
    n = rows * cols
    xs = unit(x)
    edges = []
    for i in range(n):
        for j in range(i + 1, n):
            ri, ci, rj, cj = *divmod(i, cols), *divmod(j, cols)
            if kept[i] and kept[j] and abs(ri - rj) <= 1 and abs(ci - cj) <= 1:
                edges.append((i, j, min(2.0, max(0.0, 1 - float(xs[i] @ xs[j])))))
    threshold = plain_otsu([d for *_, d in edges], False)
    parent = list(range(n))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j, d in edges:
        if threshold is not None and d <= threshold:
            a, b = root(i), root(j)
            parent[max(a, b)] = min(a, b)
    parts = {}
    for i in range(n):
        if kept[i]:
            parts.setdefault(root(i), []).append(i)
    anchors, dropped = set(), set()
    for members in parts.values():
        if len(members) < 2:
            continue
        mean = x[members].mean(dim=0)
        far = [float(((x[m] - mean) ** 2).sum()) for m in members]
        anchor = members[far.index(min(far))]
        anchors.add(anchor)
        dropped |= set(members) - {anchor}
    return parts, anchors, dropped


@pytest.mark.parametrize("seed", range(4))
def test_the_long_term_merge_is_connected_parts_and_their_anchors(seed):
    torch.manual_seed(seed)
    base = torch.randn(3, 6, dtype=torch.float64)
    x = base[torch.randint(0, 3, (12,))] + 0.05 * torch.randn(12, 6, dtype=torch.float64)
    kept = torch.rand(12) > 0.15
    part, anchor, dropped = tiers.long_term_merge(x, kept, GRID)
    parts, anchors, gone = plain_merge(x, kept.tolist(), GRID)
    assert set(anchor.nonzero()[:, 0].tolist()) == anchors
    assert set(dropped.nonzero()[:, 0].tolist()) == gone
    for first, members in parts.items():  # a part is labelled by its first token
        assert part[members].tolist() == [first] * len(members)


Watched = watched(fluxmem.FluxMemMemory)


def plain_memory(frames, short, mid, grid, params):
    """The three tiers over frames [(stream indices, embeddings)]: the indices kept, and per
    anchor the indices its part averaged."""
    kept = {}
    keep_of, anchors = {}, {}
    previous = {}
    for f, (_, x) in enumerate(frames):
        if f:
            previous[f] = 1 - plain_best(x, frames[f - 1][1], grid)
        leaving = f - short  # the frame this one pushes out of the short term
        if leaving >= 0:
            similar = plain_best(frames[leaving][1], frames[leaving + 1][1], grid)
            to_next = plain_otsu(1 - similar, True)
            to_previous = plain_otsu(previous[leaving], True) if leaving in previous else None
            keep_of[leaving] = [
                ((1 - s) >= to_next or (to_previous is not None and p >= to_previous))
                and not s > params.direct_drop_similarity
                for s, p in zip(
                    similar.tolist(), previous.get(leaving, torch.zeros(len(similar))).tolist()
                )
            ]
            merging = leaving - mid
            if merging >= 0:
                parts, merged, dropped = plain_merge(frames[merging][1], keep_of[merging], grid)
                for a in merged:
                    members = next(m for m in parts.values() if a in m)
                    anchors[int(frames[merging][0][a])] = [int(frames[merging][0][m])
                                                           for m in members]  # fmt: skip
                keep_of[merging] = [k and t not in dropped for t, k in
                                    enumerate(keep_of[merging])]  # fmt: skip
    for f, (index, _) in enumerate(frames):
        for t, i in enumerate(index.tolist()):
            kept[i] = keep_of.get(f, [True] * len(index))[t]
    return sorted(i for i, k in kept.items() if k), anchors


@pytest.mark.parametrize("chunk_frames", [64, 4])
def test_the_memory_keeps_what_the_three_tiers_keep(backbones, chunk_frames):
    backbone = backbones["tiny-llava-ov"]  # one frame a step
    choice = choose("fluxmem", chunk_frames=chunk_frames, short_term_frames=3, mid_term_frames=4)
    watched = Watched(choice.params, choice.budget, EncodeContext("video"))
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=16)
    encode_media(backbone, media, with_policy(choice, watched))
    grid = backbone.stream_layout((64, 64), [(0.0, 0.0)]).grid
    kept, anchors = plain_memory(watched.frames, 3, 4, grid, choice.params)
    assert watched.kept == kept
    assert anchors, "the clip must merge some parts"
    keys, values = watched.held
    for anchor, members in anchors.items():
        local = watched.kept.index(anchor)
        want = torch.stack([watched.before[m][0].double() for m in members]).mean(dim=0)
        assert torch.allclose(keys[:, local].double(), want, atol=1e-5)
        want = torch.stack([watched.before[m][1].double() for m in members]).mean(dim=0)
        assert torch.allclose(values[:, local].double(), want, atol=1e-5)
    assert math.isfinite(float(keys.sum()))
