"""CausalMem: the basis update and the foreground's choice written out plainly in float64 from the
definitions (the authors' FOSSCache), against mmkv's memory on the same embeddings; each frame's
background entry is the mean K and V of every token of it ever dropped."""

from collections import defaultdict

import pytest
import torch

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods import EncodeContext, causalmem
from tests.conftest import SAMPLES
from tests.helpers import choose, watched, with_policy


def plain_update(basis, usage, x, decay, new, k_max):
    """One frame's basis update: decay usage toward mean |coefficient|, add the least explained
    tokens' residuals by Gram-Schmidt, keep the k_max most used in their order."""
    coefficients = x @ basis
    left = x - coefficients @ basis.T
    usage = decay * usage + (1 - decay) * coefficients.abs().mean(dim=0)
    worst = sorted(range(len(x)), key=lambda i: -float(left[i].norm()))[:new]
    columns = [basis[:, j] for j in range(basis.shape[1])]
    added = []
    for i in worst:
        v = left[i].clone()
        for u in columns + added:
            v = v - (u @ v) * u
        added.append(v / v.norm())
    basis = torch.stack(columns + added, dim=1)
    usage = torch.cat([usage, torch.ones(len(added), dtype=usage.dtype)])
    if basis.shape[1] > k_max:
        top = sorted(sorted(range(len(usage)), key=lambda j: -float(usage[j]))[:k_max])
        basis, usage = basis[:, top], usage[top]
    return basis, usage


def test_the_basis_update_is_the_definitions():
    torch.manual_seed(0)
    x0, x1 = torch.randn(12, 10, dtype=torch.float64), torch.randn(12, 10, dtype=torch.float64)
    params = causalmem.CausalMemParams(k_max=7, new_directions=3)
    basis = causalmem.first_basis(x0, params.k_max).double()
    assert torch.allclose(basis.T @ basis, torch.eye(7, dtype=torch.float64), atol=1e-9)
    ours, our_usage = causalmem.update_basis(basis, torch.ones(7, dtype=torch.float64), x1, params)
    want, want_usage = plain_update(basis, torch.ones(7, dtype=torch.float64), x1, 0.9, 3, 7)
    # the same directions (a direction's sign is QR's choice) and the same usage
    assert torch.allclose(ours @ ours.T, want @ want.T, atol=1e-9)
    assert torch.allclose(our_usage, want_usage, atol=1e-12)


def test_over_the_budget_the_best_scored_stay_and_backgrounds_count():
    score = torch.tensor([0.5, 0.9, 0.1, 0.7, float("-inf")])
    valid = torch.tensor([True, True, True, True, False])
    # 4 held + 1 background > 4: keep max(2, 4 - 1) = 3
    kept = causalmem.keep_foreground(score, valid, torch.tensor(1), cap=4, floor=2)
    assert kept.tolist() == [True, True, False, True, False]
    # under the budget nothing goes
    assert causalmem.keep_foreground(score, valid, torch.tensor(0), 4, 2).tolist() == valid.tolist()
    # the floor holds however many backgrounds there are
    kept = causalmem.keep_foreground(score, valid, torch.tensor(3), cap=4, floor=2)
    assert kept.tolist() == [False, True, False, True, False]


Watched = watched(causalmem.CausalMemMemory)


def plain_memory(frames, cap, params):
    """The FOSSCache loop over frames [(stream indices, embeddings)]: (foreground indices, per
    frame the indices dropped into its background)."""
    basis = usage = None
    foreground, dropped = [], defaultdict(list)  # (index, step, embedding)
    for step, (index, x) in enumerate(frames):
        if basis is None:
            basis = torch.linalg.svd(x, full_matrices=False).Vh[: min(params.k_max, *x.shape)].T
            usage = torch.ones(basis.shape[1], dtype=torch.float64)
        else:
            basis, usage = plain_update(
                basis, usage, x, params.decay, params.new_directions, params.k_max
            )
        foreground += [(int(i), step, row) for i, row in zip(index, x)]
        if len(foreground) + len(dropped) > cap:
            energy = [float((e - basis @ (basis.T @ e)).norm()) for _, _, e in foreground]
            low, high = min(energy), max(energy)
            score = [(e - low) / max(high - low, 1e-6) for e in energy]
            allowed = max(min(params.min_foreground, cap), cap - len(dropped))
            order = sorted(range(len(foreground)), key=lambda i: -score[i])[:allowed]
            for i in set(range(len(foreground))) - set(order):
                dropped[foreground[i][1]].append(foreground[i][0])
            foreground = [foreground[i] for i in sorted(order)]
    return sorted(i for i, _, _ in foreground), dropped


@pytest.mark.parametrize("chunk_frames", [64, 4])
def test_the_memory_keeps_what_the_definition_keeps(backbones, chunk_frames):
    backbone = backbones["tiny-llava-ov"]
    choice = choose("causalmem", budget_tokens=40, chunk_frames=chunk_frames, k_max=6,
                    new_directions=2, min_foreground=10)  # fmt: skip
    watched = Watched(choice.params, choice.budget, EncodeContext("video"))
    media = load_media(str(SAMPLES / "clip.mp4"), fps=4.0, max_frames=12)
    encode_media(backbone, media, with_policy(choice, watched))
    foreground, dropped = plain_memory(watched.frames, 40, choice.params)
    assert dropped, "the clip must go over the budget"
    kept = watched.kept
    backgrounds = sorted(set(kept) - set(foreground))
    assert set(foreground) <= set(kept) and len(backgrounds) == len(dropped)
    keys, values = watched.held
    for step, indices in dropped.items():
        slot = [i for i in backgrounds if i in indices]
        assert len(slot) == 1, step  # held where one of its dropped tokens was
        local = kept.index(slot[0])
        want_k = torch.stack([watched.before[i][0].double() for i in indices]).mean(dim=0)
        want_v = torch.stack([watched.before[i][1].double() for i in indices]).mean(dim=0)
        assert torch.allclose(keys[:, local].double(), want_k, atol=1e-5)
        assert torch.allclose(values[:, local].double(), want_v, atol=1e-5)
