"""AirCache (seed 003): visual KV pruned by what the instruction's most relevant tokens look at.

An elite observation window (instruction tokens the last instruction token attends to with at least
tau x its maximum) scores every visual token by the elite rows' mean attention (softmax over
[visual; elite] keys); each layer's share of the budget follows the strength and the skewness of
those scores. Text KV is never touched. At encode the instruction is the guidance prompt; at ask
(`--prune aircache`) the question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.methods.base import Budget, GuidedParams, Method, Paper
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import top_in_order


@dataclass(frozen=True)
class AirCacheParams(GuidedParams):
    tau: float = knob(
        0.9,
        "elite window: attention from the last instruction token >= tau x its maximum",
        low=0,
        high=1,
    )
    min_layer_ratio: float = knob(
        0.01, "no layer keeps less than this share of its visual tokens", low=0, high=1
    )


# --- scoring: pure functions over tensors ---


def elite_window(last_row: torch.Tensor, tau: float) -> torch.Tensor:
    """Indices of the instruction tokens whose attention from the last one is >= tau x the
    largest."""
    return (last_row >= tau * last_row.max()).nonzero().squeeze(1)


def visual_importance(
    rows: torch.Tensor, visual: slice, instruction: slice, tau: float
) -> torch.Tensor:
    """rows [q, k]: attention of the instruction's rows (the last q keys are theirs) -> [n_visual]
    importance.

    instruction: the key columns of the instruction's tokens, which are also its rows (in the same
    order).
    """
    n_instruction = instruction.stop - instruction.start
    own = rows[-n_instruction:]  # the instruction's rows
    elite = elite_window(own[-1, instruction], tau)
    picked = own[elite]
    columns = torch.cat([picked[:, visual], picked[:, instruction][:, elite]], dim=1)
    columns = columns / columns.sum(dim=1, keepdim=True).clamp_min(1e-12)  # over [visual; elite]
    return columns[:, : visual.stop - visual.start].mean(dim=0)


def skewness(x: torch.Tensor) -> float:
    x = x.float()
    spread = x.std(unbiased=False)
    return float(((x - x.mean()) ** 3).mean() / spread**3) if spread > 0 else 0.0


def fit_shares(weights: list[float], mean: float, low: float, high: float) -> list[float]:
    """Per-layer ratios proportional to `weights`, each in [low, high], averaging `mean` (water
    filling: layers over `high` are capped first and their excess goes to the others; then layers
    under `low`)."""
    out: dict[int, float] = {}
    free = list(range(len(weights)))
    target = mean * len(weights)
    while free:
        w = {i: max(weights[i], 1e-12) for i in free}
        scale = target / sum(w.values())
        over = [i for i in free if w[i] * scale > high]
        under = [i for i in free if w[i] * scale < low] if not over else []
        if not over and not under:
            out.update({i: w[i] * scale for i in free})
            break
        for i in over or under:
            out[i] = high if over else low
            target -= out[i]
            free.remove(i)
    return [out[i] for i in range(len(weights))]


def layer_ratios(importance: list[torch.Tensor], ratio: float, low: float) -> list[float]:
    """r_l = 0.5 (s' + k') r: s the strength (sum), k the skewness of a layer's importance, each
    normalised to sum to one across layers (skewness floored just above zero), fitted so the layers
    average r."""
    strength = torch.tensor([float(i.sum()) for i in importance]).clamp_min(1e-12)
    skew = torch.tensor([skewness(i) for i in importance]).clamp_min(1e-6)
    weights = (0.5 * (strength / strength.sum() + skew / skew.sum())).tolist()
    return fit_shares(weights, ratio, low, 1.0)


def keep_per_layer(importance: list[torch.Tensor], ratio: float, low: float) -> list[torch.Tensor]:
    """Local indices (temporal order) each layer keeps of its visual tokens."""
    kept = []
    for scores, r in zip(importance, layer_ratios(importance, ratio, low)):
        kept.append(
            top_in_order(scores, max(1, min(scores.numel(), math.floor(r * scores.numel()))))
        )
    return kept


def prune_at_ask(rows, visual, question, budget: float, params: AirCacheParams):
    """Per layer: rows [q, k], the question's attention over [context | question] after its forward;
    the key columns of the visual tokens and of the question."""
    importance = [visual_importance(r, v, q, params.tau) for r, v, q in zip(rows, visual, question)]
    return keep_per_layer(importance, budget, params.min_layer_ratio)


class AirCacheMemory(KeepAll):
    """At encode: the guidance prompt is the instruction."""

    def finish(self, state: StreamState) -> None:
        guidance = self.context.guidance(self.params.guidance_prompt)
        rows, visual, instruction = state.attend(guidance, rows=True)
        tau = self.params.tau
        importance = [visual_importance(r, v, i, tau) for r, v, i in zip(rows, visual, instruction)]
        share = self.budget.share_of(state.total)
        for layer, local in enumerate(
            keep_per_layer(importance, share, self.params.min_layer_ratio)
        ):
            if len(local) < state.cache.count(layer):
                state.cache.retain(layer, local)


METHOD = Method(
    name="aircache",
    label="AirCache",
    description="visual KV pruned by an elite window of the instruction; per-layer budgets",
    paper=Paper(
        "AirCache: Activating Inter-modal Relevancy KV Cache Compression for Efficient Large "
        "Vision-Language Model Inference",
        2025,
        "https://arxiv.org/abs/2503.23956",
    ),
    params=AirCacheParams,
    budget=Budget(share=0.1),  # the paper's headline: within ~1% of full at 10% of the visual KV
    streaming=AirCacheMemory,
    prune_at_ask=prune_at_ask,
)
