"""MuKV's candidate dedup (the authors' `_select_tokens_with_dedup`), an option off by default as
in their run scripts: checked against the code's loop written out here, on hand-made keys (issue
51)."""

import torch
from safetensors import safe_open

from mmkv_cli import api
from mmkv_cli.core.options import MethodSpec
from mmkv_cli.methods.mukv import MuKVParams, dedup_top
from tests.helpers import encode_pack


def reference(score, keys, keep, similarity, widen):
    """The code's selection as it is written: a nested loop over the candidates, best first."""
    wide = min(int(keep * widen), score.numel())
    candidates = score.topk(wide).indices.tolist()
    if wide <= keep:
        return sorted(candidates[:keep])
    unit = keys[candidates] / keys[candidates].norm(dim=1, keepdim=True)
    alike = unit @ unit.T
    standing = [True] * wide
    for i in range(wide):
        if not standing[i]:
            continue
        for j in range(i + 1, wide):
            if alike[i, j] > similarity:
                if score[candidates[i]] < score[candidates[j]]:
                    standing[i] = False
                    break
                standing[j] = False
    left = [c for c, s in zip(candidates, standing) if s]
    if len(left) > keep:
        left = sorted(left, key=lambda c: -float(score[c]))[:keep]
    return sorted(left)


def clustered(n: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys in `groups` tight clusters (near-duplicates within each), and distinct scores."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(groups, 16, generator=generator)
    keys = centres[torch.arange(n) % groups] + 0.05 * torch.randn(n, 16, generator=generator)
    return torch.randperm(n, generator=generator).float(), keys


def test_dedup_keeps_what_the_codes_loop_keeps():
    for seed in range(20):
        score, keys = clustered(60, groups=40, seed=seed)  # a few duplicates among the candidates
        for keep in (5, 10, 20):
            want = reference(score, keys, keep, 0.9, 1.2)
            got = dedup_top(score, keys, keep, 0.9, 1.2).tolist()
            if len(want) == keep:
                assert got == want, (seed, keep)
            else:  # the code keeps fewer; mmkv fills the block with the best dropped ones
                dropped = sorted(set(score.topk(int(keep * 1.2)).indices.tolist()) - set(want))
                best = sorted(dropped, key=lambda c: -float(score[c]))[: keep - len(want)]
                assert got == sorted(want + best), (seed, keep)


def test_dedup_drops_a_duplicate_of_a_better_token_and_keeps_distinct_ones():
    keys = torch.eye(6)
    keys[1] = keys[0] + 0.01  # token 1 is a copy of token 0, which scores better
    score = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    assert dedup_top(score, keys, 4, 0.9, 1.5).tolist() == [0, 2, 3, 4]
    assert dedup_top(score, keys, 4, 0.9999, 1.5).tolist() == [0, 1, 2, 3]  # not alike enough
    assert dedup_top(score, keys, 4, 0.9, 1.0).tolist() == [0, 1, 2, 3]  # no spare candidates


def test_a_pack_encoded_with_dedup_holds_as_many_tokens_and_other_ones(tmp_path, backbones):
    assert MuKVParams().dedup is False  # off, as the authors' scripts run it
    backbone = backbones["tiny-llava-ov"]
    packs = {}
    dedup = {"dedup": True, "dedup_similarity": 0.9, "dedup_candidates": 2.0}
    for name, params in (("plain", {}), ("dedup", dedup)):
        out = tmp_path / f"{name}.kvpack"
        method = MethodSpec("mukv", params)
        encode_pack("samples/clip.mp4", out, method=method, backbone=backbone, max_frames=8)
        with safe_open(str(out), "numpy") as f:
            packs[name] = (api.inspect(out), f.get_tensor("blocks.pos"))
    (plain, plain_positions), (deduped, dedup_positions) = packs["plain"], packs["dedup"]
    assert deduped["visual_tokens_kept"] == plain["visual_tokens_kept"]  # blocks as planned
    assert deduped["blocks"] == plain["blocks"]
    assert plain_positions.shape == dedup_positions.shape
    assert (plain_positions != dedup_positions).any()  # other tokens chosen
