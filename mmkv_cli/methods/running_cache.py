"""The running encode cache as streaming memory policies see it.

`RunningCache` is one per-layer store: each layer holds [prompt | front | visual] in the model's
cache, and for every visual entry its index in the whole visual stream and the position it sits at.
Policies evict, overwrite and insert through `retain`, `replace` and `insert_front`; the splicing of
cache tensors happens in one place (`_splice`). Each visual entry is marked pristine while its K, V
and position are still what the forward made for its stream index (evictions keep the mark, a
`replace` clears it), so a checkpoint can write those once, by stream index. `StreamState` is the
cache with the stream around it, as the StreamingMemory protocol (base.py) hands it to a policy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from mmkv_cli.core.lazy import torch
from mmkv_cli.kernels.host import HostCopies
from mmkv_cli.kernels.rope import rotate_keys
from mmkv_cli.methods.archive import Archive


class RunningCache:
    """Per layer: the model's cache entries, and for the visual ones their stream index and
    position."""

    def __init__(self, cache, prompt_len: int, position_dims: int):
        self.cache = cache  # a transformers DynamicCache; its layers hold [1, H_kv, n, D]
        self.prompt_len = prompt_len
        layers = len(cache.layers)
        self.front = [0] * layers  # tokens between the prompt and the visual part (a summary token)
        # per layer, how far its prompt's positions (and keys) were moved from the layout's: a
        # policy that continues each layer after its own last entry moves a layer as a whole
        self.prompt_shift = [0] * layers
        self.index = [torch.empty(0, dtype=torch.long) for _ in range(layers)]
        self.positions = [torch.empty(position_dims, 0, dtype=torch.long) for _ in range(layers)]
        # per layer, entries moved out of attention but kept for the pack, on the host
        self.archive = [Archive() for _ in range(layers)]
        # False while the pack's blocks are made as each chunk goes in (encode/sealing.py): what
        # leaves attention is in the pack already, and a second host copy would double its memory
        self.archive_offloaded = True
        # per layer, per visual entry: K, V and position are still what the forward made for its
        # stream index. Such an entry's bytes never change while it is held, whatever is evicted
        # around it, so a checkpoint writes them once (an hour of `full` or a 25% window: GBs)
        self.pristine = [torch.empty(0, dtype=torch.bool) for _ in range(layers)]
        # per layer, once a policy kept tokens per KV head: which visual entries each head holds
        # ([H_kv, n] bool; None: every head holds every entry). An entry stays while any head holds
        # it; attention is masked so a head sees only its own (kernels.attention.masking)
        self.heads: list[torch.Tensor | None] = [None] * layers
        self.streamed = 0  # the stream has come this far: indices [0, streamed) appended or dropped

    @property
    def layers(self) -> int:
        return len(self.index)

    def fork(self) -> RunningCache:
        """A cache sharing every tensor with this one, copying none: nothing here is written in
        place (appends, cuts and splices make new tensors; the archive's forks append to slabs of
        their own), so what either does after leaves the other as it was. A live stream's memory
        at a moment is played on a fork, at the cost of the bookkeeping, not of the KV."""
        fork = copy.copy(self)
        fork.cache = copy.copy(self.cache)
        fork.cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        fork.front, fork.index = list(self.front), list(self.index)
        fork.prompt_shift = list(self.prompt_shift)
        fork.positions, fork.pristine = list(self.positions), list(self.pristine)
        fork.heads = list(self.heads)
        fork.archive = [archive.fork() for archive in self.archive]
        return fork

    def count(self, layer: int) -> int:
        """Visual entries this layer holds."""
        return int(self.index[layer].numel())

    def head_entries(self, layer: int) -> list[torch.Tensor]:
        """Per KV head, the visual entries it holds (indices into the layer's visual part,
        ascending): all of them while the layer is not held per head."""
        held = self.heads[layer]
        if held is None:
            return [torch.arange(self.count(layer))] * int(self.cache.layers[layer].keys.shape[1])
        return [row.nonzero().squeeze(1) for row in held.cpu()]

    def visual_start(self, layer: int) -> int:
        return self.prompt_len + self.front[layer]

    def visual(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's visual K, V as [H_kv, n, D] views."""
        entry = self.cache.layers[layer]
        start = self.visual_start(layer)
        stop = start + self.count(layer)
        return entry.keys[0, :, start:stop], entry.values[0, :, start:stop]

    def appended(self, index: torch.Tensor, positions: torch.Tensor) -> None:
        """A forward added these visual tokens (stream indices, positions [P, n]) to every layer's
        end."""
        fresh = torch.ones(len(index), dtype=torch.bool)
        for layer in range(self.layers):
            held = self.heads[layer]
            if held is not None:  # what the forward added, every head holds
                self.heads[layer] = torch.cat([held, held.new_ones(held.shape[0], len(index))], 1)
            self.index[layer] = torch.cat([self.index[layer], index])
            self.positions[layer] = torch.cat([self.positions[layer], positions], dim=1)
            self.pristine[layer] = torch.cat([self.pristine[layer], fresh])
        self.streamed = max(self.streamed, int(index[-1]) + 1) if len(index) else self.streamed

    def passed(self, stop: int) -> None:
        """The stream has come up to index `stop`: what a token reducer dropped of it was never
        appended, yet a checkpoint cuts the stream there."""
        self.streamed = max(self.streamed, stop)

    def retain(self, layer: int, local: torch.Tensor) -> None:
        """Keep only the visual entries at `local` (indices into this layer's visual part,
        ascending)."""
        keys, values = self.visual(layer)
        at = local.to(keys.device, non_blocking=True)  # host to device: no wait
        self._splice(layer, self.visual_start(layer), self.count(layer), keys[:, at], values[:, at])
        self.index[layer] = self.index[layer][local.cpu()]
        self.positions[layer] = self.positions[layer][:, local.cpu()]
        self.pristine[layer] = self.pristine[layer][local.cpu()]
        held = self.heads[layer]
        if held is not None:
            self.heads[layer] = held[:, local.to(held.device)]

    def leaving(self, layer: int, kept_local: torch.Tensor) -> tuple:
        """The visual K, V (where the cache is) and positions this layer lets go when it keeps
        only `kept_local`."""
        keys, values = self.visual(layer)
        gone = torch.ones(keys.shape[1], dtype=torch.bool)
        gone[kept_local] = False
        gone = gone.nonzero().squeeze(1)
        at = gone.to(keys.device, non_blocking=True)
        return keys[:, at], values[:, at], self.positions[layer][:, gone]

    def retain_heads(self, layer: int, local: list[torch.Tensor]) -> None:
        """Keep, for each KV head h, only the visual entries at `local[h]` (indices into this
        layer's visual part, ascending; heads may keep different numbers). The entries no head
        keeps go; the rest stay once, marked with the heads that hold them. Heads that all keep the
        same entries are a plain `retain`: the pack stays per layer."""
        count = self.count(layer)
        held = torch.zeros(len(local), count, dtype=torch.bool)
        for head, at in enumerate(local):
            held[head, at.cpu()] = True
        if self.heads[layer] is not None:
            held &= self.heads[layer].cpu()
        kept = held.any(dim=0)
        agree = self.heads[layer] is None and bool((held == held[:1]).all())
        self.retain(layer, kept.nonzero().squeeze(1))
        self.heads[layer] = None if agree else held[:, kept]

    def replace_held(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite what each KV head holds of this layer's visual part with its own rows of
        `keys`, `values` ([H_kv, k, D], each head's k in its entries' order; every head as many)."""
        held = self.heads[layer]
        if held is None:
            self.replace(layer, keys, values)
            return
        at = held.to(keys.device, non_blocking=True)
        old_k, old_v = self.visual(layer)
        new_k, new_v = old_k.clone(), old_v.clone()
        new_k[at] = keys.reshape(-1, keys.shape[-1]).to(new_k)  # row-major: head by head
        new_v[at] = values.reshape(-1, values.shape[-1]).to(new_v)
        self.replace(layer, new_k, new_v)

    def head_masks(self) -> dict[int, torch.Tensor]:
        """For a forward over this cache: per layer held per head, which of its entries up to the
        visual part's end each KV head sees ([H_kv, n] bool; the prompt and front: every head)."""
        masks = {}
        for layer, held in enumerate(self.heads):
            if held is not None:
                before = torch.ones(held.shape[0], self.visual_start(layer), dtype=torch.bool)
                masks[layer] = torch.cat([before, held.cpu()], dim=1)
        return masks

    def replace(
        self,
        layer: int,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Overwrite this layer's visual K and/or V ([H_kv, n, D]) and/or positions ([P, n]), n
        unchanged."""
        old_k, old_v = self.visual(layer)
        keys = old_k if keys is None else keys
        values = old_v if values is None else values
        self._splice(layer, self.visual_start(layer), self.count(layer), keys, values)
        self.pristine[layer] = torch.zeros_like(self.pristine[layer])  # rewritten, or moved
        if positions is not None:
            self.positions[layer] = positions.to(self.positions[layer])

    def prompt(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's prompt K, V (the text before the stream) as [H_kv, prompt_len, D] views."""
        entry = self.cache.layers[layer]
        return entry.keys[0, :, : self.prompt_len], entry.values[0, :, : self.prompt_len]

    def replace_prompt(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite this layer's prompt K and V (a policy that merges evicted tokens into text);
        the pack's prefix is read back from the cache after the stream."""
        self._splice(layer, 0, self.prompt_len, keys, values)

    def offload(self, layer: int, count: int) -> None:
        """Move this layer's `count` oldest visual entries out of the attention window to host
        memory; they still go into the pack (a sliding window at encode, as ReKV streams)."""
        if self.heads[layer] is not None:
            raise RuntimeError("internal: a cache held per head is not offloaded")
        keys, values = self.visual(layer)
        # copied into the archive's slabs: never views, which would keep the whole cache tensor
        # they were cut from alive (on the CPU, .cpu() returns the view itself)
        if self.archive_offloaded:
            self.archive[layer].add(
                keys[:, :count],
                values[:, :count],
                self.positions[layer][:, :count],
                self.index[layer][:count],
            )
        self.retain(layer, torch.arange(count, self.count(layer)))

    @property
    def per_head(self) -> bool:
        """Some layer's heads hold different entries: the pack stores each (layer, KV head) as a
        layer of its own (docs/kvpack.md)."""
        return any(held is not None for held in self.heads)

    def take_all_held(self) -> list[tuple]:
        """Per layer, everything it keeps for the pack: K, V [H_kv, n, D] on the host (offloaded
        entries first), positions [P, n], stream indices [n]; held per head (`per_head`), per
        (layer, KV head) in that order, [1, n_h, D] each. Every layer's K/V is sent to pinned
        host memory first and waited for once, not once a layer. The offloaded entries are handed
        over (the archives empty): at an hour of video they are GBs, and a second host copy of
        every layer would double the encode's memory while the pack is made."""
        layers = range(self.layers)
        copies = HostCopies(self.cache.layers[0].keys.device) if self.layers else None
        sent = [tuple(copies.host(t) for t in self.visual(layer)) for layer in layers]
        if copies:
            copies.settle()
        held = [
            self.archive[layer].take_joined(
                (*sent[layer], self.positions[layer], self.index[layer])
            )
            for layer in layers
        ]
        if not self.per_head:
            return held
        return [
            part
            for (keys, values, positions, index), heads in zip(held, self.heads)
            for part in by_head(keys, values, positions, index, heads)
        ]

    def add(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, index: int, position: torch.Tensor
    ) -> None:
        """Append one visual entry ([H_kv, 1, D], position [P]) made by the policy, not the forward,
        under stream index `index` (one this layer no longer holds): it is held, scored and
        evicted as any other entry, and goes into that index's step in the pack."""
        end = self.visual_start(layer) + self.count(layer)
        self._splice(layer, end, 0, key, value)
        self.index[layer] = torch.cat([self.index[layer], torch.tensor([index])])
        self.positions[layer] = torch.cat(
            [self.positions[layer], position.view(-1, 1).to(self.positions[layer])], dim=1
        )
        self.pristine[layer] = torch.cat([self.pristine[layer], torch.zeros(1, dtype=torch.bool)])
        held = self.heads[layer]
        if held is not None:  # every head holds what a policy made
            self.heads[layer] = torch.cat([held, held.new_ones(held.shape[0], 1)], dim=1)

    def shift_layer(self, layer: int, by: int, rope: tuple) -> None:
        """Move this layer as a whole `by` positions up: its prompt, front and visual entries,
        keys re-rotated (RoPE: what they attend to among themselves is unchanged; what comes next
        now follows closer). rope: (inv_freq, axes)."""
        if len(self.archive[layer]) or self.heads[layer] is not None:
            raise RuntimeError("internal: a layer with archived or per-head entries is not moved")
        entry = self.cache.layers[layer]
        end = self.visual_start(layer) + self.count(layer)
        dims = self.positions[layer].shape[0]
        delta = torch.full((dims, end), by, dtype=torch.long)
        moved = rotate_keys(entry.keys[0, :, :end], delta, *rope)
        self._splice(layer, 0, end, moved, entry.values[0, :, :end])
        self.positions[layer] = self.positions[layer] + by
        self.pristine[layer] = torch.zeros_like(self.pristine[layer])  # rewritten
        self.prompt_shift[layer] += by

    def insert_front(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Put one token ([H_kv, 1, D]) right after the prompt of this layer, replacing the one
        there."""
        self._splice(layer, self.prompt_len, self.front[layer], key, value)
        self.front[layer] = 1

    def _splice(self, layer: int, start: int, length: int, keys, values) -> None:
        """Cache entries [start, start + length) of this layer become `keys`, `values` ([H_kv, m,
        D])."""
        entry = self.cache.layers[layer]
        stop = start + length
        k, v = keys.to(entry.keys).unsqueeze(0), values.to(entry.values).unsqueeze(0)
        entry.keys = torch.cat([entry.keys[:, :, :start], k, entry.keys[:, :, stop:]], dim=2)
        entry.values = torch.cat([entry.values[:, :, :start], v, entry.values[:, :, stop:]], dim=2)

    @contextmanager
    def scratch(self):
        """Whatever a forward appends inside this block is cut off again on leaving it."""
        lengths = [int(e.keys.shape[2]) for e in self.cache.layers]
        try:
            yield lengths
        finally:
            for entry, n in zip(self.cache.layers, lengths):
                entry.keys, entry.values = entry.keys[:, :, :n], entry.values[:, :, :n]

    def kv_bytes(self) -> int:
        return sum(
            e.keys.numel() * e.keys.element_size() * 2
            for e in self.cache.layers
            if e.keys is not None
        )


def by_head(keys, values, positions, index, heads: torch.Tensor | None) -> list[tuple]:
    """One layer's held entries (K, V [H_kv, n, D], positions [P, n], index [n]) split into what
    each KV head holds (`heads` [H_kv, n]; None: all): [(K, V [1, n_h, D], positions, index)]."""
    out = []
    for head in range(keys.shape[0]):
        at = slice(None) if heads is None else heads[head].nonzero().squeeze(1)
        one = slice(head, head + 1)
        out.append((keys[one, at], values[one, at], positions[:, at], index[at]))
    return out


# text -> per layer the attention its rows pay the cached visual tokens (or, rows=True, the raw
# rows; reducers={name: fn}: each reducer's per-head total over the rows, per layer)
Attend = Callable[..., object]


@dataclass
class StreamState:
    """The running cache and the stream around it, as a streaming memory policy sees them."""

    cache: RunningCache
    token_step: torch.Tensor  # [total] temporal step of every visual token
    layout_positions: torch.Tensor  # [P, total + 1] the layout's positions, then the suffix's first
    total: int  # visual tokens the whole media will give
    seen: int = 0  # visual tokens streamed so far
    prefilled: int = 0  # of those, the ones a token reducer let through (all, without one)
    shift: int = 0  # subtracted from layout positions of tokens still to come (set by compaction)
    position_limit: int = 1 << 30  # the model's max_position_embeddings
    rope: tuple | None = None  # (inv_freq, axes) for delta-rotating cached keys
    grid: tuple[int, int] | None = None  # a temporal step's visual tokens as (rows, cols)
    attend: Attend | None = field(default=None, repr=False)
    family: str = ""  # the backbone's family, for a method whose authors' code differs by it
    frames_per_step: int = 1  # frames one temporal step holds (Qwen's 2: its temporal patch)
    # text as the language model takes it in: its input embeddings [n, H] (SAVEMem's questions)
    embed_text: Callable[[str], torch.Tensor] | None = field(default=None, repr=False)
    # the last chunk's grid tokens as the language model took them in, [S, T, H] on the model's
    # device, and their stream indices [S, T] (host): set only for a policy that reads_embeddings
    chunk_grid: torch.Tensor | None = field(default=None, repr=False)
    chunk_index: torch.Tensor | None = field(default=None, repr=False)

    @property
    def layers(self) -> int:
        return self.cache.layers

    def placed(self, start: int, stop: int) -> torch.Tensor:
        """[P, n] positions the visual tokens [start, stop) are placed at now."""
        return self.layout_positions[:, start:stop] - self.shift


def continue_after_each_layer(
    state: StreamState, also_held: dict[int, int] | None = None
) -> list[int]:
    """Place what streams in next right after each layer's own furthest position, as HERMES' code
    places each layer's next chunk (its furthest on any axis, plus one): the stream goes on after
    the furthest layer, and every other layer moves up as a whole to meet it (`shift_layer`).
    also_held: per layer, the position of an entry the cache does not place (a summary kept in
    front). Returns each layer's move."""
    running = state.cache
    prompt_end = int(state.layout_positions[0, 0]) - 1  # the prompt ends where the stream begins
    ends = []
    for layer in range(state.layers):
        held = running.positions[layer]  # host bookkeeping: no wait
        end = int(held.max()) if held.numel() else prompt_end + running.prompt_shift[layer]
        ends.append(max(end, (also_held or {}).get(layer, end)))
    upcoming = int(state.placed(state.seen, state.seen + 1)[0, 0])
    state.shift += upcoming - (max(ends) + 1)  # the next token follows the furthest layer
    moves = [max(ends) - end for end in ends]
    for layer, by in enumerate(moves):
        if by:
            running.shift_layer(layer, by, state.rope)
    return moves
