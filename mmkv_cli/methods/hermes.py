"""HERMES (seed 002): the KV cache as layered memory under a fixed token budget, streamed in chunks.

Whenever the visual part of the running cache exceeds the budget, every layer is cut back to it. Shallow
layers keep the newest tokens (a forgetting curve), deep layers the tokens a generic guidance prompt attends
to, middle layers a depth-interpolated mix; scores are smoothed deep -> shallow and each layer keeps its own
top-k. What deep layers evict is folded into one summary token, kept in the running cache right after the
prompt. Positions stay (`lazy`, compacted only near the model's position limit) or are compacted at every
compression (`eager`), keys re-rotated by the change. Everything kept goes into the pack; ask uses all of it
(no retrieval).
"""

from __future__ import annotations

import math

import torch

from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy, StreamState
from mmkv_cli.methods.mukv import minmax, top_in_order
from mmkv_cli.pack.format import Segment, block_name
from mmkv_cli.rope import compact_positions, rotate_keys

# --- scoring: pure functions over tensors ---


def layer_roles(layers: int, shallow: float, deep: float) -> list[tuple[str, float]]:
    """(role, depth fraction p within the middle layers) per layer; at least one shallow and one deep layer."""
    n_shallow = max(1, round(shallow * layers))
    n_deep = max(1, round(deep * layers))
    n_middle = max(0, layers - n_shallow - n_deep)
    roles = []
    for layer in range(layers):
        if layer < n_shallow:
            roles.append(("shallow", 0.0))
        elif layer >= layers - n_deep:
            roles.append(("deep", 1.0))
        else:
            i = layer - n_shallow
            roles.append(("middle", i / (n_middle - 1) if n_middle > 1 else 0.5))
    return roles


def mix_for(role: str, p: float, params: dict) -> tuple[float, float]:
    """(a, k): the recency weight and the forgetting-curve steepness of a layer."""
    if role == "shallow":
        return 1.0, float(params["recency_k"][0])
    if role == "deep":
        return 0.0, float(params["recency_k"][1])
    a0, a1 = params["middle_a"]
    k0, k1 = params["recency_k"]
    return a0 + (a1 - a0) * p, k0 + (k1 - k0) * p


def recency_curve(count: int, k: float) -> torch.Tensor:
    """exp(-k d) over `count` tokens in cache order, d = normalised age (0 for the newest)."""
    age = (count - 1 - torch.arange(count, dtype=torch.float32)) / max(1, count)
    return torch.exp(-k * age)


def layer_score(attention: torch.Tensor, a: float, k: float) -> torch.Tensor:
    """S = (1 - a) minmax(attention) + a minmax(recency)."""
    return (1 - a) * minmax(attention) + a * minmax(recency_curve(attention.numel(), k))


def smooth_deep_to_shallow(
    scores: list[torch.Tensor], kept: list[torch.Tensor], gammas: list[float], total: int
) -> list[torch.Tensor]:
    """S_l <- (1 - g_l) S_l + g_l S_{l+1}, from the deepest layer up, matching tokens by stream index.

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
    """Evicted keys [H, n, D] rotated to `target` [P] and averaged, values averaged; merged with a previous
    (key [H, 1, D], value [H, 1, D], count) as a running mean. Returns (key, value, count)."""
    n = keys.shape[1]
    delta = target.view(-1, 1).to(positions) - positions
    moved = rotate_keys(keys.float(), delta, inv_freq, axes)
    k_sum, v_sum = moved.sum(dim=1, keepdim=True), values.float().sum(dim=1, keepdim=True)
    if previous is not None:
        pk, pv, count = previous
        k_sum, v_sum, n = k_sum + pk.float() * count, v_sum + pv.float() * count, n + count
    return k_sum / n, v_sum / n, n


# --- the memory policy ---


class HermesMemory(MemoryPolicy):
    name = "hermes"

    def __init__(self, budget: float, params: dict):
        super().__init__(budget, params)
        self.summary: dict[int, tuple] = {}  # deep layer -> (key, value, count)
        self.layer_positions: list[torch.Tensor] | None = (
            None  # per layer, positions of its kept tokens
        )
        self.tracked: list[int] = []  # per layer, how many of its kept tokens have a position entry
        self.compressions = 0
        self.reindexed = 0

    def capacity(self, state: StreamState) -> int:
        fixed = self.params.get("budget_tokens")
        return int(fixed) if fixed else max(1, math.floor(self.budget * state.total))

    def positions_of(self, state: StreamState, layer: int) -> torch.Tensor:
        self._track(state)
        return self.layer_positions[layer]

    def _track(self, state: StreamState) -> None:
        """Give tokens appended since the last call their placed positions."""
        if self.layer_positions is None:
            self.layer_positions = [state.positions[:, :0].clone() for _ in range(state.layers)]
            self.tracked = [0] * state.layers
        for layer in range(state.layers):
            new = state.kept[layer][self.tracked[layer] :]
            self.layer_positions[layer] = torch.cat(
                [self.layer_positions[layer], state.positions[:, new]], dim=1
            )
            self.tracked[layer] = len(state.kept[layer])

    def after_chunk(self, state: StreamState) -> None:
        if len(state.kept[0]) > self.capacity(state):
            self._compress(state, self.capacity(state))

    def finish(self, state: StreamState) -> None:
        # Deep layers hold one token under the budget: their summary token fills the last slot.
        cap = self.capacity(state)
        deep_over = any(
            len(state.kept[l]) > cap - 1
            for l, (role, _) in enumerate(self._roles(state))
            if role == "deep" and self.params.get("summary", True)
        )
        if len(state.kept[0]) > cap or deep_over:
            self._compress(state, cap)

    def _roles(self, state: StreamState) -> list[tuple[str, float]]:
        return layer_roles(
            state.layers, float(self.params["shallow_share"]), float(self.params["deep_share"])
        )

    def _compress(self, state: StreamState, cap: int) -> None:
        self._track(state)
        roles = self._roles(state)
        attention = state.attend(str(self.params["guidance_prompt"]))
        scores = [
            layer_score(attention[layer], *mix_for(role, p, self.params))
            for layer, (role, p) in enumerate(roles)
        ]
        gammas = [float(self.params["smoothing"][role]) for role, _ in roles]
        scores = smooth_deep_to_shallow(scores, state.kept, gammas, state.total)
        summary = bool(self.params.get("summary", True))
        for layer, (role, _) in enumerate(roles):
            keep = cap - 1 if summary and role == "deep" else cap  # the summary token is the cap-th
            count = len(state.kept[layer])
            if count <= keep:
                continue
            local = top_in_order(scores[layer], keep)
            if summary and role == "deep":
                self._fold(state, layer, local)
            state.retain(layer, local)
            self.layer_positions[layer] = self.layer_positions[layer][:, local]
            self.tracked[layer] = len(state.kept[layer])
        self.compressions += 1
        if self._should_reindex(state):
            self._reindex(state)

    def _fold(self, state: StreamState, layer: int, kept_local: torch.Tensor) -> None:
        keys, values = state.visual_kv(layer)
        gone = torch.ones(keys.shape[1], dtype=torch.bool)
        gone[kept_local] = False
        gone = gone.nonzero().squeeze(1)
        inv_freq, axes = state.rope
        target = state.positions[:, 0]  # the summary sits at the first visual position
        self.summary[layer] = fold_into_summary(
            keys[:, gone.to(keys.device)].cpu(),
            values[:, gone.to(values.device)].cpu(),
            self.layer_positions[layer][:, gone],
            target,
            inv_freq,
            axes,
            self.summary.get(layer),
        )
        # The summary lives in the running cache, right after the prompt, so what streams in later attends
        # to it (the paper writes it back into the KV cache).
        key, value, _ = self.summary[layer]
        state.set_front(layer, key, value)

    def _should_reindex(self, state: StreamState) -> bool:
        mode = self.params.get("reindex", "lazy")
        if mode == "eager":
            return True
        if mode != "lazy":
            raise ValueError(f"unknown re-index mode '{mode}' (lazy, eager)")
        limit = self.params.get("reindex_at") or int(0.9 * state.position_limit)
        return int(state.positions[:, : state.seen].max()) > limit

    def _reindex(self, state: StreamState) -> None:
        """Compact every layer's visual positions right after the prompt, re-rotate the cached keys, and move
        the rest of the stream up to follow them."""
        inv_freq, axes = state.rope
        start = state.prefix_len
        top = start - 1
        for layer in range(state.layers):
            old = self.layer_positions[layer]
            new = compact_positions(old, start)
            entry = state.cache.layers[layer]
            cut = state.visual_start(layer)
            end = cut + old.shape[1]
            moved = rotate_keys(
                entry.keys[:, :, cut:end], (new - old).to(entry.keys.device), inv_freq, axes
            )
            entry.keys = torch.cat([entry.keys[:, :, :cut], moved, entry.keys[:, :, end:]], dim=2)
            self.layer_positions[layer] = new
            if new.numel():
                top = max(top, int(new[0].max()))
        # The next token (a visual step or the suffix) takes the temporal slot after the compacted ones.
        upcoming = int(state.layout_positions[0, state.seen])
        state.shift = upcoming - (top + 1)
        self.reindexed += 1

    def make_blocks(
        self, state: StreamState, step_times: list[tuple[float, float]]
    ) -> list[Segment]:
        blocks = super().make_blocks(state, step_times)
        if not self.summary:
            return blocks
        shape = state.visual_kv(0)[0]
        empty = torch.zeros(shape.shape[0], 0, shape.shape[2], dtype=shape.dtype)
        keys, values, positions = [], [], []
        for layer in range(state.layers):
            if layer in self.summary:
                k, v, _ = self.summary[layer]
                keys.append(k.to(shape.dtype))
                values.append(v.to(shape.dtype))
                positions.append(state.positions[:, :1].clone())
            else:
                keys.append(empty)
                values.append(empty.clone())
                positions.append(state.positions[:, :0].clone())
        first = step_times[0][0]
        summary = Segment(
            name="summary",
            keys=keys,
            values=values,
            positions=positions,
            granularity="summary",
            steps=(0, 0),
            time=(first, first),
            representative=None,
        )
        renamed = [summary, *blocks]
        for i, block in enumerate(renamed):
            block.name = block_name(i)
        return renamed


MEMORY, CONTEXT = HermesMemory, ContextPolicy
