"""HERMES (seed 002): the KV cache as layered memory under a fixed token budget, streamed in chunks.

Whenever the visual part of the running cache exceeds the budget, every layer is cut back to it.
Shallow layers keep the newest tokens (a forgetting curve), deep layers the tokens a global
pseudo-question attends to, middle layers a depth-interpolated mix scored by the local and global
pseudo-questions joined, as the authors' code asks them; scores are smoothed deep -> shallow and
each layer keeps its own top-k. What deep layers evict is folded into a summary token, appended to
the running cache as an ordinary token that later compressions score, may evict and fold again
(the authors' code; `summary_as: running_mean` keeps one apart instead); its position follows the
layer's last kept token, and what streams in next follows each layer's furthest entry (a layer
moves as a whole to meet the stream), as in the authors' code. Positions stay (`lazy`, compacted
only near the model's position limit) or are compacted at every compression (`eager`), keys
re-rotated by every move. Everything kept goes into the pack; ask uses all of it (no retrieval).

Smoothing pairs a layer's score with the deeper layer's score of the same stream token, as the paper
means; the authors' code pairs cache slots, which hold different tokens once layers diverge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmkv_cli.core.lazy import torch
from mmkv_cli.core.spec import knob
from mmkv_cli.kernels.rope import compact_positions, rotate_keys
from mmkv_cli.methods.base import Budget, GuidedParams, Method, Paper
from mmkv_cli.methods.hermes_scoring import (
    family_curves,
    layer_roles,
    layer_score,
    mix_for,
    role_questions,
    smooth_deep_to_shallow,
)
from mmkv_cli.methods.hermes_summary import SummaryTokens
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.running_cache import StreamState, continue_after_each_layer
from mmkv_cli.methods.scoring import top_in_order


@dataclass(frozen=True)
class Smoothing:
    shallow: float = knob(0.1, "g of shallow layers", low=0, high=1)
    middle: float = knob(0.3, "g of middle layers", low=0, high=1)
    deep: float = knob(0.4, "g of deep layers", low=0, high=1)

    def of(self, role: str) -> float:
        return {"shallow": self.shallow, "middle": self.middle, "deep": self.deep}[role]


# The pseudo-questions each layer role is scored by (the authors' code asks one of each kind; these
# are mmkv's words for them): the local one about what is in view now, the global one about the
# whole stream so far; middle layers ask both, joined.
LOCAL_QUESTION = (
    "Describe what is in view right now: each object, the small movements, and where things are "
    "relative to one another."
)
GLOBAL_QUESTION = (
    "Tell the story of the whole video so far: who appears, the main events in order, what "
    "changed over time, and what it is about."
)


@dataclass(frozen=True)
class HermesParams(GuidedParams):
    shallow_share: float = knob(
        0.1, "share of layers that are shallow (pure recency)", low=0, high=1
    )
    deep_share: float = knob(0.3, "share of layers that are deep (pure attention)", low=0, high=1)
    curves: Literal["backbone", "llava_ov", "qwen"] = knob(
        "backbone",
        "whose middle-layer recency weights: the authors' file for the backbone's family "
        "(llavaov_hermes.py for LLaVA-OV, qwenvl_hermes.py for Qwen2/2.5/3-VL), or one file's "
        "for every backbone",
    )
    recency_k: tuple[float, float] | None = knob(
        None,
        "forgetting-curve steepness k: shallow value, then the deepest middle layer's (null: the "
        "curves' file: 20 -> 0.5 LLaVA-OV, 20 -> 8 Qwen)",
    )
    middle_a: tuple[float, float] | None = knob(
        None,
        "recency weight a across middle layers: first, then last (null: the curves' file: "
        "1 - 0.9 p LLaVA-OV, 0.75 - 0.6 p Qwen)",
        low=0,
        high=1,
    )
    smoothing: Smoothing = knob(Smoothing(), "cross-layer smoothing g per role, deep -> shallow")
    prompts: Literal["roles", "one"] = knob(
        "roles",
        "roles: middle layers score by the local and global pseudo-questions joined, deep ones by "
        "the global one (the authors' code); one: every layer by the guidance prompt (the paper)",
    )
    local_question: str = knob(LOCAL_QUESTION, "roles: the pseudo-question about what is in view")
    global_question: str = knob(GLOBAL_QUESTION, "roles: the pseudo-question about the story")
    previous_turn: bool = knob(
        False,
        "roles: put a live stream's last question and answer before both, as the authors' code "
        "does (off: a live answer equals the answer from a pack of the stream cut there)",
    )
    summary: bool = knob(True, "deep layers fold what they evict into one summary token")
    summary_as: Literal["token", "running_mean"] = knob(
        "token",
        "token: each compression's summary is an ordinary cached token that later ones score, may "
        "evict and fold again with weight 1 (the authors' code); running_mean: one token a layer, "
        "kept apart and never scored, the count-weighted mean of all ever folded",
    )
    summary_at: Literal["after_kept", "after_prompt"] = knob(
        "after_kept",
        "where the summary token sits: after the layer's last kept token (the authors' code) or "
        "right after the prompt, before the stream",
    )
    reindex: Literal["eager", "lazy"] = knob(
        "eager",
        "eager: compact positions at every compression (offline); "
        "lazy: only near the position limit (streaming)",
    )
    reindex_at: int | None = knob(
        None,
        "lazy threshold (null: the model's max_position_embeddings - 1024, as the authors' code)",
        low=1,
    )
    continue_at: Literal["layer_end", "stream"] = knob(
        "layer_end",
        "after a compression, what streams in next follows each layer's own last entry (the "
        "authors' per-layer start positions; a layer moves as a whole to meet it) or the stream's "
        "next position in every layer (mmkv before issue 72)",
    )


def curves_for(params: HermesParams, family: str) -> dict[str, tuple[float, float]]:
    """The (a, k) curves a backbone of `family` uses: the file `curves` names (the family's own
    by default; a family without a file of its own takes LLaVA-OV's), each set field over it."""
    return family_curves(params.curves, family, params.middle_a, params.recency_k)


# --- the memory policy ---


class HermesMemory(SummaryTokens, KeepAll):
    def after_chunk(self, state: StreamState) -> None:
        cap = self.budget.tokens_of(state.total)
        if state.cache.count(0) > cap:
            self._compress(state, cap)

    def finish(self, state: StreamState) -> None:
        # Deep layers hold one token under the budget: their summary token fills the last slot.
        cap = self.budget.tokens_of(state.total)
        deep_over = self.params.summary and any(
            state.cache.count(layer) > cap - 1
            for layer, (role, _) in enumerate(self._roles(state))
            if role == "deep"
        )
        if state.cache.count(0) > cap or deep_over:
            self._compress(state, cap)

    def _roles(self, state: StreamState) -> list[tuple[str, float]]:
        return layer_roles(state.layers, self.params.shallow_share, self.params.deep_share)

    def _attention(self, state: StreamState, roles: list[tuple[str, float]]) -> list[torch.Tensor]:
        """Per layer, the attention its role's pseudo-question pays each visual token. A guidance
        prompt given (encode --guidance-prompt, or the parameter) scores every layer, as `one`."""
        chosen = self.context.guidance_prompt or self.params.guidance_prompt
        if self.params.prompts == "one" or chosen:
            return state.attend(self.context.guidance(self.params.guidance_prompt))
        turn = self.context.turns[-1] if self.params.previous_turn and self.context.turns else None
        asked = role_questions(self.params.local_question, self.params.global_question, turn)
        needed = sorted({role for role, _ in roles if role != "shallow"})  # shallow weighs it 0
        attended = dict(zip(needed, state.attend([asked[role] for role in needed])))
        device = next(iter(attended.values()))[0].device if attended else None
        flat = [torch.ones(state.cache.count(n), device=device) for n in range(state.layers)]
        return [attended.get(role, flat)[layer] for layer, (role, _) in enumerate(roles)]

    def _compress(self, state: StreamState, cap: int) -> None:
        roles = self._roles(state)
        attention = self._attention(state, roles)
        curves = curves_for(self.params, state.family)
        scores = [
            layer_score(attention[layer], *mix_for(role, p, curves))
            for layer, (role, p) in enumerate(roles)
        ]
        gammas = [self.params.smoothing.of(role) for role, _ in roles]
        ids, total = self._smoothing_ids(state)
        scores = smooth_deep_to_shallow(scores, ids, gammas, total)
        evicted = {}  # deep layer -> what it lets go, folded once positions settle
        for layer, (role, _) in enumerate(roles):
            folds = self.params.summary and role == "deep"
            keep = cap - 1 if folds else cap  # the summary token is the cap-th
            if state.cache.count(layer) <= keep:
                continue
            local = top_in_order(scores[layer], keep)
            if folds:
                evicted[layer] = state.cache.leaving(layer, local)
                if self.params.summary_as == "token":
                    self.summary_mask[layer] = self._summaries(state, layer)[local]
            state.cache.retain(layer, local)
        if self._should_reindex(state):
            self._reindex(state)
        if self.params.summary_as == "token":
            for layer, gone in evicted.items():
                self._add_summary(state, layer, gone)
        else:
            for layer in sorted(set(self.summary) | set(evicted)):
                self._fold(state, layer, evicted.get(layer))
        if self.params.continue_at == "layer_end":
            self._continue_each_layer(state)

    def _continue_each_layer(self, state: StreamState) -> None:
        """What comes next follows each layer's furthest entry (a running-mean summary in front
        counts, and moves with its layer)."""
        front = {n: int(slot.max()) for n, slot in self.summary_position.items()}
        moves = continue_after_each_layer(state, front)
        for layer, held in self.summary.items():
            self.summary_position[layer] = self.summary_position[layer] + moves[layer]
            if held is not None and moves[layer]:
                key, value, count = held
                delta = torch.full((len(self.summary_position[layer]), 1), moves[layer])
                self.summary[layer] = (rotate_keys(key, delta, *state.rope), value, count)

    def _should_reindex(self, state: StreamState) -> bool:
        if self.params.reindex == "eager":
            return True
        limit = self.params.reindex_at or max(1, state.position_limit - 1024)
        return int(state.placed(0, state.seen).max()) > limit

    def _reindex(self, state: StreamState) -> None:
        """Compact every layer's visual positions right after the prompt, re-rotate the cached keys,
        and move the rest of the stream up to follow them (and the summary slot after them)."""
        inv_freq, axes = state.rope
        start = state.cache.prompt_len
        top = start - 1
        for layer in range(state.layers):
            old = state.cache.positions[layer]
            new = compact_positions(old, start + state.cache.prompt_shift[layer])
            keys, _ = state.cache.visual(layer)
            moved = rotate_keys(keys, new - old, inv_freq, axes)
            state.cache.replace(layer, keys=moved, positions=new)
            if new.numel():
                top = max(top, int(new.max()))
        if self.params.summary and self.params.summary_at == "after_kept":
            top += 1  # a deep layer's summary may take the slot after its kept tokens
        # The next token (a visual step or the suffix) takes the temporal slot after the compacted
        # ones.
        upcoming = int(state.layout_positions[0, state.seen])
        state.shift = upcoming - (top + 1)


METHOD = Method(
    name="hermes",
    label="HERMES",
    description="streaming layered memory, fixed 4K-token budget, summary token, no retrieval",
    start_here="a live stream or a long video in a memory of fixed size",
    paper=Paper(
        "HERMES: KV Cache as Hierarchical Memory for Efficient Streaming Video Understanding",
        2026,
        "https://arxiv.org/abs/2601.14724",
    ),
    params=HermesParams,
    budget=Budget(tokens=4096),  # the paper's 4K setting (hermes-6k: 6144)
    streaming=HermesMemory,
)
