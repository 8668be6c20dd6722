"""The tiers a streaming memory of frames moves through (FluxMem's, and SAVEMem's built on them):
the newest frames kept whole (short term), then what a frame keeps of itself as it leaves them
(mid term), then what it keeps as it leaves those (long term). The choices are made by the tokens
as the language model took them in (StreamState.chunk_grid), as the authors' code makes them over
the model's input embeddings; the KV of what goes leaves the cache after each chunk, in one wait.
The neighbourhood similarity, Otsu's threshold and the connected-part merge are shared here as
pure functions over tensors."""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field, replace

from mmkv_cli.core.errors import MediaError
from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.host import HostCopies
from mmkv_cli.methods.base import Budget
from mmkv_cli.methods.keep_all import KeepAll
from mmkv_cli.methods.merging import SlotMeans
from mmkv_cli.methods.running_cache import StreamState

BINS = 128  # Otsu's histogram over distances in [0, 2], as the authors' code's


@functools.lru_cache(maxsize=8)  # one grid a stream: made once, never written into
def neighbours(grid: tuple[int, int], centre: bool) -> torch.Tensor:
    """[T, T] bool: which places of a (rows, cols) grid are within one row and one column of each
    other (each place itself too when `centre`)."""
    rows, cols = grid
    r = torch.arange(rows * cols) // cols
    c = torch.arange(rows * cols) % cols
    near = ((r[:, None] - r[None, :]).abs() <= 1) & ((c[:, None] - c[None, :]).abs() <= 1)
    return near if centre else near & ~torch.eye(rows * cols, dtype=torch.bool)


def best_neighbour_similarity(
    query: torch.Tensor, other: torch.Tensor, near: torch.Tensor
) -> torch.Tensor:
    """[T]: each token's best cosine with the tokens of `other` at the 3x3 places around its own
    (query, other: unit rows [T, H]; near: `neighbours(grid, centre=True)` on their device),
    at most 1 as in exact arithmetic (an unchanged token is at distance 0, never below)."""
    return (query @ other.T).masked_fill(~near, float("-inf")).amax(dim=1).clamp(max=1.0)


def otsu(values: torch.Tensor, mask: torch.Tensor, median_fallback: bool):
    """(threshold, found): Otsu's threshold of the masked values, clamped to [0, 2], over a
    128-bin histogram, as two device scalars. Where the values are all alike (variance <= 1e-12)
    or no split separates them, the lower median with `median_fallback`, else found is False."""
    v = values.float().clamp(0.0, 2.0)
    weight = mask.float()
    count = weight.sum()
    bins = (v * (BINS / 2)).long().clamp(0, BINS - 1)
    p = torch.zeros(BINS, device=v.device).index_add_(0, bins, weight) / count.clamp_min(1)
    centres = (torch.arange(BINS, device=v.device) + 0.5) * (2.0 / BINS)
    omega, mu = torch.cumsum(p, 0), torch.cumsum(p * centres, 0)
    between = (mu[-1] * omega - mu) ** 2 / (omega * (1.0 - omega)).clamp_min(1e-12)
    between = between.masked_fill((omega < 1e-6) | (1.0 - omega < 1e-6), -1.0)
    best = torch.argmax(between)
    threshold = (best + 0.5) * (2.0 / BINS)
    found = (between[best] > 0) & (count > 0)
    if not median_fallback:
        return threshold, found
    ordered = torch.sort(v.masked_fill(~mask, float("inf"))).values
    median = ordered[((count.long() - 1).clamp_min(0)) // 2]
    mean = (v * weight).sum() / count.clamp_min(1)
    flat = ((v - mean) ** 2 * weight).sum() / (count - 1) <= 1e-12
    return torch.where(flat | ~found, median, threshold), count > 0


def differs(
    next_similarity: torch.Tensor, previous_distance: torch.Tensor | None, fixed: float | None
) -> torch.Tensor:
    """[T] bool: a frame's tokens at least the threshold away (1 - best cosine) from the next
    frame, or from the frame before where it had one; each side's threshold Otsu's over the
    frame's distances (the lower median where they are alike), or 1 - `fixed` where given."""
    distance = 1.0 - next_similarity
    every = torch.ones_like(distance, dtype=torch.bool)

    def threshold(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if fixed is not None:
            return torch.tensor(min(2.0, max(0.0, 1.0 - fixed)), device=d.device)
        return otsu(d, mask, median_fallback=True)[0]

    keep = distance >= threshold(distance, every)
    if previous_distance is not None:
        valid = previous_distance >= 0
        keep = keep | (valid & (previous_distance >= threshold(previous_distance, valid)))
    return keep


def long_term_merge(x: torch.Tensor, kept: torch.Tensor, grid: tuple[int, int]):
    """(part [T], anchor [T] bool, dropped [T] bool) of a frame leaving the mid term: its kept
    tokens (x [T, H] as embedded) joined by 8-neighbour edges no longer (1 - cosine) than Otsu's
    threshold of those edges; a part's label is its first token. A part of two or more keeps its
    anchor (the member nearest its mean, the first of equals) and drops the rest. Shapes are
    fixed: nothing is read by the host."""
    total, device = len(x), x.device
    x = x.float()
    unit = torch.nn.functional.normalize(x, p=2, dim=1, eps=1e-8)
    pairs = neighbours(grid, centre=False).to(device, non_blocking=True).triu(1)
    pairs = pairs & kept[:, None] & kept[None, :]
    distance = (1.0 - unit @ unit.T).clamp(0.0, 2.0)
    threshold, found = otsu(distance.flatten(), pairs.flatten(), median_fallback=False)
    edges = pairs & (distance <= threshold) & found
    reach = (edges | edges.T | torch.diag(kept)).float()
    for _ in range(max(1, math.ceil(math.log2(total)))):  # paths of up to 2^k steps
        reach = ((reach @ reach) > 0).float()
    order = torch.arange(total, device=device)
    part = torch.where(reach > 0, order, total).amin(dim=1)  # a dropped token: part `total`
    # a part of two is a tie in exact arithmetic (its first stays): float64 keeps it one
    wide = x.double()
    ones = torch.ones(total, device=device, dtype=wide.dtype)
    counts = torch.zeros(total + 1, device=device, dtype=wide.dtype).index_add_(0, part, ones)
    means = torch.zeros(total + 1, x.shape[1], device=device, dtype=wide.dtype)
    means = means.index_add_(0, part, wide) / counts.clamp_min(1)[:, None]
    far = ((wide - means[part]) ** 2).sum(dim=1)
    nearest = torch.full((total + 1,), float("inf"), device=device, dtype=wide.dtype)
    nearest = nearest.scatter_reduce(0, part, far, "amin")
    first = torch.full((total + 1,), total, device=device)
    first = first.scatter_reduce(0, part, torch.where(far == nearest[part], order, total), "amin")
    merging = kept & (counts[part] > 1)
    anchor = merging & (order == first[part])
    return part, anchor, merging & ~anchor


@dataclass(eq=False)
class Frame:
    """A temporal step the memory still decides about."""

    step: int
    index: torch.Tensor  # [T] stream indices of its grid tokens (host)
    x: torch.Tensor  # [T, H] as embedded, where the model is
    held: torch.Tensor  # [T] bool: the cache holds it (a reducer may have dropped some)
    previous: torch.Tensor | None = None  # [T] distance to the frame before (None: the first)
    keep: torch.Tensor | None = None  # [T] bool on the device, once it left the short term
    # (part, anchor, what it kept before) once merged into its parts' anchors
    merge: tuple | None = field(default=None, repr=False)
    semantic: torch.Tensor | None = None  # [T] a method's importance of each token (SAVEMem's)
    scene_change: torch.Tensor | None = None  # a method's: the frame cut the scene (SAVEMem's)

    def unit(self) -> torch.Tensor:
        return torch.nn.functional.normalize(self.x.float(), p=2, dim=1, eps=1e-8)


class TieredMemory(KeepAll):
    """The three tiers; a method says what a frame keeps as it leaves each (mid_term,
    long_term), and may watch frames arrive and move on."""

    reads_embeddings = True

    def __init__(self, params, budget: Budget, context):
        super().__init__(params, budget, context)
        self.short: collections.deque[Frame] = collections.deque()
        self.mid: collections.deque[Frame] = collections.deque()
        self.added = 0  # tokens up to this stream index have joined the memory
        # with keeps_embeddings, the long term's tokens as taken in: stream indices [N] (host) and
        # unit rows [N, H] float16 where the model is (the other tiers' frames hold their own)
        self.embedded_index = torch.empty(0, dtype=torch.long)
        self.embedded_x: torch.Tensor | None = None

    FIELDS = ("previous", "keep", "semantic", "scene_change")  # a Frame's, saved when set

    def saved(self) -> dict[str, torch.Tensor]:
        out = {"added": torch.tensor(self.added), "mid": torch.tensor(len(self.mid))}
        for i, frame in enumerate([*self.mid, *self.short]):
            out |= {f"{i}.step": torch.tensor(frame.step), f"{i}.index": frame.index,
                    f"{i}.x": frame.x.cpu(), f"{i}.held": frame.held}  # fmt: skip
            for name in self.FIELDS:
                if getattr(frame, name) is not None:
                    out[f"{i}.{name}"] = getattr(frame, name).cpu()
        if self.embedded_x is not None:
            out |= {"embedded.index": self.embedded_index, "embedded.x": self.embedded_x.cpu()}
        return out | {f"own.{k}": v.cpu() for k, v in self.own_saved().items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        self.added, mid = int(saved["added"]), int(saved["mid"])
        count = len({k.split(".")[0] for k in saved} - {"added", "mid", "own", "embedded"})
        frames = []
        for i in range(count):
            frame = Frame(int(saved[f"{i}.step"]), saved[f"{i}.index"], saved[f"{i}.x"],
                          saved[f"{i}.held"])  # fmt: skip
            for name in self.FIELDS:
                setattr(frame, name, saved.get(f"{i}.{name}"))
            frames.append(frame)
        self.mid, self.short = collections.deque(frames[:mid]), collections.deque(frames[mid:])
        self.embedded_index = saved.get("embedded.index", torch.empty(0, dtype=torch.long))
        self.embedded_x = saved.get("embedded.x")
        self.own_restore({k[4:]: v for k, v in saved.items() if k.startswith("own.")})

    # --- what a method says ---

    def own_saved(self) -> dict[str, torch.Tensor]:
        """The method's own state between chunks, beside the frames'."""
        return {}

    def own_restore(self, saved: dict[str, torch.Tensor]) -> None:
        pass

    def arrived(self, frame: Frame, before: Frame | None, near: torch.Tensor) -> None:
        """A frame came: its distance to the frame before (near: the 3x3 neighbourhoods)."""
        if before is not None:
            frame.previous = 1.0 - best_neighbour_similarity(frame.unit(), before.unit(), near)

    def mid_term(self, leaving: Frame, following: Frame, near: torch.Tensor) -> torch.Tensor:
        """[T] bool: what a frame leaving the short term keeps (following: the frame after it)."""
        raise NotImplementedError

    def long_term(self, old: Frame, grid: tuple[int, int]) -> None:
        """A frame leaving the mid term: set what it keeps (old.keep) and any merge (old.merge)."""
        raise NotImplementedError

    def gone_elsewhere(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mask on the device, stream indices on the host) of tokens the method dropped outside
        the chunk's frames (SAVEMem's cap over the long term), read back with them; None: none."""
        return None

    def settled_elsewhere(self, dead: torch.Tensor) -> None:
        """What gone_elsewhere's mask says is gone, as read back with the chunk (on the host)."""

    def after_chunk(self, state: StreamState) -> None:
        grid, index = state.chunk_grid, state.chunk_index
        if grid is None or state.grid is None:
            return
        per_step = max(1, state.frames_per_step)
        short = max(1, self.params.short_term_frames // per_step)
        mid = max(0, self.params.mid_term_frames // per_step)
        held_now = torch.isin(index, state.cache.index[0])
        near = neighbours(state.grid, centre=True).to(grid.device, non_blocking=True)
        decided: list[Frame] = []
        for row in range(len(index)):
            if int(index[row, 0]) < self.added:
                continue  # a live memory's chunk seen twice: once is enough
            step = int(state.token_step[index[row, 0]])
            frame = Frame(step, index[row], grid[row], held_now[row])
            self.arrived(frame, self.short[-1] if self.short else None, near)
            self.short.append(frame)
            if len(self.short) > short:
                leaving = self.short.popleft()
                kept = self.mid_term(leaving, self.short[0], near)
                leaving.keep = kept & leaving.held.to(kept.device, non_blocking=True)
                self.mid.append(leaving)
                decided.append(leaving)
                if len(self.mid) > mid:
                    old = self.mid.popleft()
                    self.long_term(old, state.grid)
                    if old not in decided:  # left both terms in this chunk: listed once
                        decided.append(old)
        self.added = int(index[-1, -1]) + 1
        if decided:
            self._apply(state, decided)

    def _apply(self, state: StreamState, decided: list[Frame]) -> None:
        """Every decision of the chunk read back at once (its one wait): merged anchors take their
        parts' mean K and V; what is no longer kept leaves the cache."""
        total = len(decided[0].index)
        merged = [frame.merge for frame in decided if frame.merge is not None]
        rows = [frame.keep.long() for frame in decided] + [m.long() for ms in merged for m in ms]
        elsewhere = self.gone_elsewhere()
        if elsewhere is not None:
            rows += list((~elsewhere[0]).long())
        back = torch.stack(rows).cpu()
        keeps = back[: len(decided)].bool()
        if self.keeps_embeddings:
            self._keep_long_term(decided, keeps)
        merges = back[len(decided) : len(decided) + 3 * len(merged)].view(-1, 3, total)
        cached = state.cache.index[0]
        frames = [frame for frame in decided if frame.merge is not None]
        for frame, (part, anchor, members) in zip(frames, merges):
            fold = part_means(cached, frame.index, part, anchor.bool(), members.bool())
            for layer in range(state.layers):
                state.cache.replace(layer, *(fold(held) for held in state.cache.visual(layer)))
        gone = [frame.index[~keep] for frame, keep in zip(decided, keeps)]
        if elsewhere is not None:
            dead = back[len(decided) + 3 * len(merged) :].bool()
            gone.append(elsewhere[1][dead])
            self.settled_elsewhere(dead)
        gone = torch.cat(gone)
        if len(gone):
            local = (~torch.isin(cached, gone)).nonzero()[:, 0]
            for layer in range(state.layers):
                state.cache.retain(layer, local)
            if self.embedded_x is not None:  # what left the cache leaves the long term's rows too
                alive = torch.isin(self.embedded_index, gone, invert=True)
                self.embedded_index = self.embedded_index[alive]
                rows = alive.nonzero()[:, 0].to(self.embedded_x.device, non_blocking=True)
                self.embedded_x = self.embedded_x[rows]

    def _keep_long_term(self, decided: list[Frame], keeps: torch.Tensor) -> None:
        """The rows the frames that left the mid term in this chunk keep, as taken in (keeps: what
        each decided frame keeps, on the host: no wait)."""
        mid = {id(frame) for frame in self.mid}
        for frame, keep in zip(decided, keeps):
            if id(frame) in mid:
                continue
            rows = keep.nonzero()[:, 0]
            x = frame.unit()[rows.to(frame.x.device, non_blocking=True)].half()
            self.embedded_index = torch.cat([self.embedded_index, frame.index[rows]])
            self.embedded_x = x if self.embedded_x is None else torch.cat([self.embedded_x, x])

    def make_blocks(self, state: StreamState, step_times: list[tuple[float, float]]) -> list:
        """KeepAll's blocks; with keeps_embeddings each carries its tokens as taken in, one row a
        token in its layers' order (they all keep the same ones), brought to the host at once."""
        index = state.cache.index[0].clone() if self.keeps_embeddings else None
        blocks = super().make_blocks(state, step_times)
        if index is None or not blocks or state.cache.per_head:
            return blocks
        index = index[torch.argsort(state.token_step[index], stable=True)]  # the blocks' order
        frames = [*self.mid, *self.short]
        held = torch.cat([self.embedded_index, *(frame.index for frame in frames)])
        x = [self.embedded_x] if self.embedded_x is not None else []
        x = torch.cat([*x, *(frame.unit().half() for frame in frames)])
        order = torch.argsort(held)
        rows = order[torch.searchsorted(held[order], index).clamp_max(len(held) - 1)]
        # a token that is no frame's grid token (Qwen3-VL's markers): a zero row
        visual = torch.isin(index, held)
        if not torch.equal(held[rows][visual], index[visual]):
            raise MediaError("internal: a kept token's embedding was not kept")
        copies = HostCopies(x.device)
        taken = x[rows.to(x.device, non_blocking=True)]
        taken = copies.host(taken * visual.to(x.device, non_blocking=True)[:, None])
        copies.settle()
        counts = [block.layer_counts[0] for block in blocks]
        return [replace(b, embeddings=e) for b, e in zip(blocks, torch.split(taken, counts))]


def part_means(cached, index, part, anchor, members) -> SlotMeans:
    """A frame's anchors given their parts' mean K and V: cached, the cache's stream indices;
    index, part [T] the frame's tokens and their parts; members [T] what the parts were made of
    (the frame's tokens the cache holds). A part with no anchor (one token) is left alone."""
    joins = members & torch.isin(part, part[anchor])
    at = joins.nonzero()[:, 0]
    groups, group_of = torch.unique(part[at], return_inverse=True)
    anchors = index[anchor][torch.argsort(part[anchor])]  # one a part, in the parts' order
    counts = torch.bincount(group_of, minlength=len(groups))
    joining, slots = torch.searchsorted(cached, index[at]), torch.searchsorted(cached, anchors)
    return SlotMeans(group_of, joining, slots, torch.zeros_like(counts), counts)
