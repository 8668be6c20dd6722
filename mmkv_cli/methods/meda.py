"""MEDA (seed 001): per-layer budgets from cross-modal attention entropy; evicted KV merged, not
dropped.

E_l = E_TV + E_VT: the entropy of text rows over visual keys (the guidance prompt's rows at encode)
plus that of visual rows over text keys (recorded chunk by chunk while streaming), each head's
own entropy averaged over heads (the authors' compute_crossmodal_entropy).
ratio_l = softmax_l(E) * L * rho, clamped to [min_layer_ratio, 1]: layers whose attention is spread
keep more. In a layer, each KV head keeps the recent window and its own top tokens by its own
cumulative attention (3:1), as the authors' code does (`selection: per_layer`: one set a layer, by
the heads' mean); every evicted token is merged into its most cosine-similar kept key of the same
head, text (the
prompt before the video, never evicted) or visual, as paper Eq. 11 and the authors' code allow; kept
K and V absorb what merged in by the authors' pivot form (merge_evicted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.kernels.host import host_all
from mmkv_cli.kernels.recorder import Recorder
from mmkv_cli.methods.base import (
    Budget,
    GuidedParams,
    Method,
    Paper,
    score_every_knob,
    selection_knob,
)
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState
from mmkv_cli.methods.scoring import accumulate


@dataclass(frozen=True)
class MedaParams(GuidedParams):
    min_layer_ratio: float = knob(0.01, "ratio_l is clamped to [this, 1]", low=0, high=1)
    recent_share: float = knob(
        0.75,
        "recent window share of a layer's budget (M:N = 3:1, the paper; 1:1 in the authors' code)",
        low=0,
        high=1,
    )
    merge: bool = knob(True, "evicted pairs merge into their most similar kept key (same head)")
    merge_into: Literal["text_and_visual", "visual"] = knob(
        "text_and_visual",
        "merge targets: kept text and visual tokens (paper Eq. 11, authors' code) or visual only",
    )
    merge_form: Literal["pivot", "mean"] = knob(
        "pivot",
        "a kept entry j with joiners i: pivot (the authors' class) (k_j + sum (k_i + k_j) / 2) / "
        "(n + 1); mean, the plain average of j and its joiners",
    )
    entropy_heads: Literal["per_head", "head_mean"] = knob(
        "per_head",
        "per_head: each head's row entropy, then the mean over heads (the authors' "
        "compute_crossmodal_entropy); head_mean: the entropy of the head-averaged rows",
    )
    score_every: int = score_every_knob()
    selection: Literal["per_head", "per_layer"] = selection_knob()


# --- scoring: pure functions over tensors ---

ALL = slice(None)


def row_entropy(rows: torch.Tensor, columns: slice) -> torch.Tensor:
    """rows [..., r, k] attention -> [..., r] entropy of each row renormalised over `columns`."""
    sub = rows[..., columns].float()
    sub = sub / sub.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    return -(sub * (sub + 1e-12).log()).sum(dim=-1)


def head_entropy_total(block: torch.Tensor, heads: str = "per_head") -> torch.Tensor:
    """block [B, H, r, k] attention of every head -> [B] the rows' entropies (over the block's
    columns, renormalised) summed over rows: per_head, each head's entropy averaged over heads;
    head_mean, the entropy of the rows averaged over heads first (never more than per_head's, by
    concavity)."""
    if heads == "per_head":
        return row_entropy(block, ALL).mean(dim=1).sum(dim=-1)
    if heads == "head_mean":
        return row_entropy(block.mean(dim=1), ALL).sum(dim=-1)
    raise ValueError(f"unknown entropy_heads '{heads}' (per_head, head_mean)")


def entropy_ratios(entropy: list[float], rho: float, low: float = 0.01) -> list[float]:
    """softmax over layers of E_l, times L * rho, clamped to [low, 1]."""
    e = torch.tensor(entropy, dtype=torch.float64)
    ratios = torch.softmax(e, dim=0) * len(entropy) * rho
    return ratios.clamp(low, 1.0).tolist()


def recent_and_heavy(cumulative: torch.Tensor, keep: int, recent_share: float) -> torch.Tensor:
    """Local indices (ascending) of the newest round(recent_share * keep) tokens plus the others
    with the highest cumulative attention, `keep` in all."""
    n = cumulative.numel()
    keep = min(keep, n)
    recent = min(keep, round(recent_share * keep))
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[n - recent :] = True
    rest = cumulative.clone().float()
    rest[chosen] = float("-inf")
    if keep - recent > 0:
        chosen[rest.topk(keep - recent).indices] = True
    return chosen.nonzero().squeeze(1)


# The evicted-by-kept similarity is taken this many bytes at a time: whole, it is [H, evicted, kept]
# floats, 3.2 GB for one layer of a 0.5B model at 256 frames and 300 GB for a 7B at 1800.
SIMILARITY_BLOCK_BYTES = 64 << 20


def merge_evicted(
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    block_rows: int | None = None,
    form: str = "pivot",
):
    """keys, values [H, n, D]; kept: local indices, [k] for every head or [H, k] each head its own
    (ascending). Each evicted token joins the kept token whose key is most cosine-similar in the
    same head. A kept K, V with n joiners i becomes, by `form`: pivot (MEDA's class), each joiner
    first averaged with the pivot, (x_j + sum (x_i + x_j) / 2) / (n + 1); mean, (x_j + sum x_i) /
    (n + 1). block_rows: evicted tokens compared at a time (None: SIMILARITY_BLOCK_BYTES' worth).

    Returns (keys [H, k, D], values [H, k, D], target [H, n_evicted]: the kept slot each evicted
    token joined), in float32 on the keys' device.
    """
    heads, n, dim = keys.shape
    kept = kept.to(keys.device)
    kept = kept.expand(heads, -1) if kept.dim() == 1 else kept
    evicted = torch.ones(heads, n, dtype=torch.bool, device=keys.device)
    evicted.scatter_(1, kept, False)
    gone = evicted.nonzero()[:, 1].reshape(heads, -1)  # every head evicts as many

    def rows(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return t.gather(1, at.unsqueeze(-1).expand(-1, -1, dim)).float()

    k_keep, v_keep = rows(keys, kept), rows(values, kept)
    if gone.shape[1] == 0:
        return k_keep, v_keep, torch.empty(heads, 0, dtype=torch.long, device=keys.device)
    k_gone, v_gone = rows(keys, gone), rows(values, gone)
    unit = torch.nn.functional.normalize
    towards = unit(k_keep, dim=-1).transpose(1, 2)  # [H, D, kept]
    step = block_rows or max(1, SIMILARITY_BLOCK_BYTES // (4 * heads * max(1, kept.shape[1])))
    target = torch.cat(
        [
            (unit(k_gone[:, start : start + step], dim=-1) @ towards).argmax(dim=-1)
            for start in range(0, gone.shape[1], step)
        ],
        dim=1,
    )  # [H, evicted]
    joiners = torch.zeros(heads, kept.shape[1], device=keys.device)
    joiners.scatter_add_(1, target, torch.ones_like(target, dtype=torch.float32))
    count = joiners.unsqueeze(-1)
    index = target.unsqueeze(-1).expand(-1, -1, dim)
    k_in = torch.zeros_like(k_keep).scatter_add_(1, index, k_gone)  # sum of each entry's joiners
    v_in = torch.zeros_like(v_keep).scatter_add_(1, index, v_gone)
    if form == "pivot":
        k_in, v_in = (k_in + count * k_keep) / 2, (v_in + count * v_keep) / 2
    return (k_keep + k_in) / (count + 1), (v_keep + v_in) / (count + 1), target


# --- the memory policy ---


class MedaMemory(KeepAll):
    def __init__(self, params, budget, context):
        super().__init__(params, budget, context)
        self.cumulative: list[torch.Tensor] = []
        self.vt_entropy: list[float] = []
        self.visual_rows = 0

    def recorder(self, state: StreamState) -> Recorder:
        # Chunk rows are visual tokens; the text they can see is the prompt before the video.
        text = slice(0, state.cache.prompt_len)
        return Recorder(
            layers=set(range(state.layers)),
            column_sums=True,
            row_stride=self.params.score_every,
            reducers={"vt_entropy": (text, self._entropy)},
            per_head=self.params.selection == "per_head",
        )

    def _entropy(self, block: torch.Tensor) -> torch.Tensor:
        return head_entropy_total(block, self.params.entropy_heads)

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        if not self.cumulative:
            heads = (state.cache.visual(0)[0].shape[0],) if recorder.per_head else ()
            self.cumulative = [torch.zeros(*heads, state.total) for _ in range(state.layers)]
            self.vt_entropy = [0.0] * state.layers
        layers = range(state.layers)
        starts = [state.cache.visual_start(layer) for layer in layers]
        read = host_all(  # every layer's sums and entropy in one copy: one wait a chunk
            [
                recorder.column_sum[i][0, ..., s : s + state.cache.count(i)]
                for i, s in zip(layers, starts)
            ]
            + [recorder.reduced[layer]["vt_entropy"][0] for layer in layers]
        )
        for layer in layers:
            self.cumulative[layer] = accumulate(
                self.cumulative[layer], read[layer], state.cache.index[layer]
            )
            self.vt_entropy[layer] += float(read[state.layers + layer])
        self.visual_rows = state.seen

    def saved(self) -> dict[str, torch.Tensor]:
        out = {f"cumulative.{i}": c for i, c in enumerate(self.cumulative)}
        out["vt_entropy"] = torch.tensor(self.vt_entropy, dtype=torch.float64)  # exact floats
        out["visual_rows"] = torch.tensor(self.visual_rows)
        return out

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        layers = len(saved) - 2
        self.cumulative = [saved[f"cumulative.{i}"] for i in range(layers)]
        self.vt_entropy = saved["vt_entropy"].tolist()
        self.visual_rows = int(saved["visual_rows"])

    def finish(self, state: StreamState) -> None:
        guidance = self.context.guidance(self.params.guidance_prompt)
        # the guidance rows' entropy over the visual keys (one total per layer, each head's own)
        means = state.attend(guidance, reducers={"tv_entropy": self._entropy})
        tv = [float(m["tv_entropy"]) for m in means]
        vt = [e / max(1, self.visual_rows) for e in self.vt_entropy]
        share = self.budget.share_of(state.total)
        entropy = [a + b for a, b in zip(tv, vt)]
        for layer, ratio in enumerate(entropy_ratios(entropy, share, self.params.min_layer_ratio)):
            count = state.cache.count(layer)
            keep = max(1, math.floor(ratio * count))
            if keep >= count:
                continue
            scores = self.cumulative[layer][..., state.cache.index[layer]]
            share = self.params.recent_share
            if scores.dim() == 2:  # each KV head its own (the code): [H_kv, keep]
                local = torch.stack([recent_and_heavy(row, keep, share) for row in scores])
            else:
                local = recent_and_heavy(scores, keep, share)
            if self.params.merge:
                self._merge(state, layer, local)
            elif local.dim() == 2:
                state.cache.retain_heads(layer, list(local))
            else:
                state.cache.retain(layer, local)

    def _merge(self, state: StreamState, layer: int, local: torch.Tensor) -> None:
        """Evict all but `local` ([k], or [H_kv, k] each head its own) and merge what goes into the
        kept text or visual tokens (of the same head)."""
        keys, values = state.cache.visual(layer)
        text = state.cache.prompt_len if self.params.merge_into == "text_and_visual" else 0
        if text:  # the prompt's entries are candidates too (the text is always kept)
            prompt_k, prompt_v = state.cache.prompt(layer)
            keys = torch.cat([prompt_k, keys], dim=1)
            values = torch.cat([prompt_v, values], dim=1)
        prompt = torch.arange(text).expand(*local.shape[:-1], -1)
        kept = torch.cat([prompt, local + text], dim=-1)
        merged_k, merged_v, _ = merge_evicted(keys, values, kept, form=self.params.merge_form)
        if local.dim() == 2:
            state.cache.retain_heads(layer, list(local))
            state.cache.replace_held(layer, merged_k[:, text:], merged_v[:, text:])
        else:
            state.cache.retain(layer, local)
            state.cache.replace(layer, merged_k[:, text:], merged_v[:, text:])
        if text:
            state.cache.replace_prompt(layer, merged_k[:, :text], merged_v[:, :text])


METHOD = Method(
    name="meda",
    label="MEDA",
    description="per-layer budgets from cross-modal attention entropy, kept per KV head, evicted "
    "KV merged into kept",
    paper=Paper(
        "MEDA: Dynamic KV Cache Allocation for Efficient Multimodal Long-Context Inference",
        2025,
        "https://arxiv.org/abs/2502.17599",
    ),
    params=MedaParams,
    budget=Budget(share=0.2),  # rho: the paper's 20% setting
    streaming=MedaMemory,
)
