"""HERMES' scoring as pure functions over tensors: the layer roles, the per-backbone curves, the
forgetting curve, the pseudo-questions, cross-layer smoothing and the summary fold (the memory
policy: hermes.py)."""

from __future__ import annotations

import math

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.rope import rotate_keys
from mmkv_cli.methods.scoring import minmax

# The authors' middle-layer curves per backbone file (HERMES commit 8d699b1): the recency weight a
# at the first and last middle layer, and the forgetting-curve steepness k at the shallow layers and
# the deepest middle one; both linear in the middle layer's depth p.
CURVES = {
    "llava_ov": {"middle_a": (1.0, 0.1), "recency_k": (20.0, 0.5)},  # a = 1 - 0.9p, k = 20 - 19.5p
    "qwen": {"middle_a": (0.75, 0.15), "recency_k": (20.0, 8.0)},  # a = 0.75 - 0.6p, k = 20 - 12p
}
CURVES_OF_FAMILY = {
    "llava_onevision": "llava_ov",
    "qwen2_vl": "qwen",
    "qwen2_5_vl": "qwen",
    "qwen3_vl": "qwen",
}


def family_curves(
    curves: str,
    family: str,
    middle_a: tuple[float, float] | None = None,
    recency_k: tuple[float, float] | None = None,
) -> dict[str, tuple[float, float]]:
    """The curves of file `curves` ("backbone": the family's own; a family without a file of its
    own takes LLaVA-OV's), with `middle_a` / `recency_k` over them where given."""
    chosen = CURVES_OF_FAMILY.get(family, "llava_ov") if curves == "backbone" else curves
    set_here = {"middle_a": middle_a, "recency_k": recency_k}
    return {**CURVES[chosen], **{k: v for k, v in set_here.items() if v is not None}}


def mix_for(role: str, p: float, curves: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """(a, k): the recency weight and the forgetting-curve steepness of a layer."""
    k0, k1 = curves["recency_k"]
    if role == "shallow":
        return 1.0, k0
    if role == "deep":
        return 0.0, k1
    a0, a1 = curves["middle_a"]
    return a0 + (a1 - a0) * p, k0 + (k1 - k0) * p


def layer_roles(layers: int, shallow: float, deep: float) -> list[tuple[str, float]]:
    """(role, depth fraction p within the middle layers) per layer, split as the authors' code does:
    the first int(shallow L) layers are shallow, deep ones start at int((1 - deep) L), and middle
    layer i (from 0) of n sits at p = i / n."""
    n_shallow = _floor(shallow * layers)
    deep_start = max(n_shallow, _floor((1 - deep) * layers))
    n_middle = deep_start - n_shallow
    roles = []
    for layer in range(layers):
        if layer < n_shallow:
            roles.append(("shallow", 0.0))
        elif layer >= deep_start:
            roles.append(("deep", 1.0))
        else:
            roles.append(("middle", (layer - n_shallow) / n_middle))
    return roles


def _floor(x: float) -> int:
    """int() of a share times a layer count, immune to 0.7 * 10 = 6.9999999."""
    return int(math.floor(x + 1e-9))


def recency_curve(count: int, k: float) -> torch.Tensor:
    """exp(-k d) over `count` tokens in cache order, d = age / (count - 1): 0 for the newest, 1 for
    the oldest."""
    age = (count - 1 - torch.arange(count, dtype=torch.float32)) / max(1, count - 1)
    return torch.exp(-k * age)


def role_questions(local: str, global_: str, turn: tuple[str, str] | None = None) -> dict[str, str]:
    """The pseudo-question each layer role is scored by: shallow the local one (its weight is 0:
    shallow layers keep by recency alone), middle both joined by '; ', deep the global one; each
    after the last question and its answer when `turn` is given."""
    if turn is not None:
        said = f"Question: {turn[0]} Answer: {turn[1]}"
        local = f"Find what is in view about: {said}. {local}"
        global_ = f"Given what was asked: {said}. {global_}"
    return {"shallow": local, "middle": f"{local}; {global_}", "deep": global_}


def layer_score(attention: torch.Tensor, a: float, k: float) -> torch.Tensor:
    """S = (1 - a) minmax(attention) + a minmax(recency)."""
    return (1 - a) * minmax(attention) + a * minmax(recency_curve(attention.numel(), k))


def smooth_deep_to_shallow(
    scores: list[torch.Tensor], kept: list[torch.Tensor], gammas: list[float], total: int
) -> list[torch.Tensor]:
    """S_l <- (1 - g_l) S_l + g_l S_{l+1}, from the deepest layer up, matching tokens by stream
    index.

    Layers may hold different tokens: a token the deeper layer no longer holds keeps its own score.
    """
    out = [s.clone() for s in scores]
    for layer in range(len(scores) - 2, -1, -1):
        deeper = torch.full((total,), float("nan"))
        deeper[kept[layer + 1]] = out[layer + 1]
        pulled = deeper[kept[layer]]
        have = ~pulled.isnan()
        g = gammas[layer]
        out[layer][have] = (1 - g) * out[layer][have] + g * pulled[have]
    return out


def fold_into_summary(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    target: torch.Tensor,
    inv_freq: torch.Tensor,
    axes: torch.Tensor,
    previous: tuple | None = None,
) -> tuple:
    """Evicted keys [H, n, D] rotated to `target` [P] and averaged, values averaged; merged with a
    previous (key [H, 1, D], value [H, 1, D], count) as a running mean. Returns (key, value, count).
    """
    n = keys.shape[1]
    delta = target.view(-1, 1).to(positions) - positions
    moved = rotate_keys(keys.float(), delta, inv_freq, axes)
    k_sum, v_sum = moved.sum(dim=1, keepdim=True), values.float().sum(dim=1, keepdim=True)
    if previous is not None:
        pk, pv, count = previous
        k_sum, v_sum, n = k_sum + pk.float() * count, v_sum + pv.float() * count, n + count
    return k_sum / n, v_sum / n, n
