"""What an encode's checkpoint holds, as named tensors: a streaming encode's running cache, a
blockwise encode's finished blocks.

The running cache's visual entries are sealed by stream index: each save cuts the stream where it
has got to, and the stream indices between one save's cut and the next make a piece, written once
by the save that made the cut, holding that range's pristine entries (K and V as the forward made
them) and their indices. Evictions only take rows out of what a piece holds, so a written piece
stays good for as long as any of its rows is held; it is no longer needed once none is. Before,
pieces were cut by cache position, so the first eviction rewrote every entry after it: a policy
keeping a sliding 25% of an hour rewrote its whole window at every save (at 7B, 4.7 GB a save); and
then by fixed ranges of 8192 stream indices, so every save rewrote the range still filling (up to
460 MB a save at 7B; `full` at a save a chunk wrote twice its pack). What is not sealed is live,
rewritten at every save: the prompt and front tokens, every entry's index, position and pristine
mark, the cuts, and the K/V of the entries a policy rewrote.
"""

from __future__ import annotations

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch
from mmkv_cli.encode.checkpoint import Sealed, held
from mmkv_cli.methods.archive import Archive
from mmkv_cli.pack import Span, split_layers


def running_cache_tensors(
    running, cuts: list[int]
) -> tuple[dict[str, torch.Tensor], dict[str, Sealed]]:
    """A RunningCache as named tensors, (live, sealed). `cuts`: the stream index each save has
    cut at, this one's last (where the stream is now): piece i holds the pristine entries from
    cut i - 1 (0 for the first) to cut i. The archive's offloaded entries are sealed in its own
    whole pieces. Each layer's stream indices and pristine marks are live as runs (an hour of
    `full` or of a sliding window is one run), so the head stays small."""
    live = {
        "cache.front": torch.tensor(running.front),
        "cache.prompt_shift": torch.tensor(running.prompt_shift, dtype=torch.long),
        "cache.streamed": torch.tensor(running.streamed),
        "cache.cuts": torch.tensor(cuts, dtype=torch.long),
    }
    bounds = torch.tensor([0, *cuts])
    sealed = {}
    for layer, entry in enumerate(running.cache.layers):
        name, start = f"cache.{layer}", running.visual_start(layer)
        keys, values = running.visual(layer)
        # every pristine entry is in a piece: the last cut is where the stream is
        index, served = running.index[layer], running.pristine[layer]
        loose = (~served).nonzero().squeeze(1)
        live |= {
            f"{name}.head.k": entry.keys[0, :, :start],
            f"{name}.head.v": entry.values[0, :, :start],
            f"{name}.index": index_runs(index),
            f"{name}.pristine": flag_runs(running.pristine[layer]),
            f"{name}.loose.k": keys[:, loose.to(keys.device)],
            f"{name}.loose.v": values[:, loose.to(keys.device)],
            f"{name}.loose.pos": running.positions[layer][:, loose],
        }
        if running.heads[layer] is not None:  # held per head (InfiniPot-V): which head holds what
            live[f"{name}.heads"] = running.heads[layer].cpu()
        rows = served.nonzero().squeeze(1)
        rows = rows[torch.argsort(index[rows])]  # in stream order: each piece is a run of them
        edges = torch.searchsorted(index[rows], bounds).tolist()
        stream = (keys, values, running.positions[layer], index)
        for number, (first, stop) in enumerate(zip(edges, edges[1:])):
            if stop > first:
                sealed |= _piece(f"{name}.stream", number, rows[first:stop], stream)
        pieces, tails = running.archive[layer].pieces()
        for kind, by_start in pieces.items():
            for first, tensor in by_start.items():
                sealed[f"{name}.archive.{kind}.{first}"] = held(tensor)
        for kind, tensor in tails.items():
            live[f"{name}.archive.{kind}.tail"] = tensor
    return live, sealed


def _piece(prefix: str, number: int, rows: torch.Tensor, stream) -> dict[str, Sealed]:
    """One sealed piece: K, V [H_kv, m, D], positions [P, m] and stream indices of the visual
    entries at `rows` (in stream order); copied out only when written."""
    keys, values, positions, index = stream
    at = rows.to(keys.device)
    row_bytes, count = keys[:, :1].nbytes, len(rows)
    return {
        f"{prefix}.k.{number}": Sealed(lambda: keys[:, at], row_bytes * count),
        f"{prefix}.v.{number}": Sealed(lambda: values[:, at], row_bytes * count),
        f"{prefix}.pos.{number}": Sealed(
            lambda: positions[:, rows], positions[:, :1].nbytes * count
        ),
        f"{prefix}.index.{number}": Sealed(lambda: index[rows], 8 * count),
    }


def index_runs(index: torch.Tensor) -> torch.Tensor:
    """Stream indices as runs of consecutive ones, [r, 2] (first, length)."""
    if not len(index):
        return torch.empty(0, 2, dtype=torch.long)
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).squeeze(1) + 1
    starts = torch.cat([torch.tensor([0]), breaks])
    lengths = torch.diff(torch.cat([starts, torch.tensor([len(index)])]))
    return torch.stack([index[starts], lengths], dim=1)


def from_index_runs(runs: torch.Tensor) -> torch.Tensor:
    if runs.dim() != 2 or runs.shape[1] != 2 or bool((runs[:, 1] < 0).any()):
        raise PackError("the checkpoint is corrupted (bad stream index runs)")
    first = torch.repeat_interleave(
        runs[:, 0] - torch.cumsum(runs[:, 1], 0) + runs[:, 1], runs[:, 1]
    )
    return first + torch.arange(int(runs[:, 1].sum()))


def flag_runs(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as the lengths of its alternating runs, the first one of False (maybe 0)."""
    edges = torch.nonzero(flags[1:] != flags[:-1]).squeeze(1) + 1
    bounds = torch.cat([torch.tensor([0]), edges, torch.tensor([len(flags)])])
    lengths = torch.diff(bounds)
    return torch.cat([torch.tensor([0]), lengths]) if len(flags) and bool(flags[0]) else lengths


def from_flag_runs(lengths: torch.Tensor) -> torch.Tensor:
    if lengths.dim() != 1 or bool((lengths < 0).any()):
        raise PackError("the checkpoint is corrupted (bad pristine runs)")
    values = torch.arange(len(lengths)) % 2 == 1
    return torch.repeat_interleave(values, lengths)


def restore_running_cache(running, tensors: dict[str, torch.Tensor]) -> list[int]:
    """Put a checkpoint's tensors back into `running`, taking them out of `tensors` as they go
    (pieces no held entry needs any more are dropped): the archive keeps the loaded pieces
    themselves (no second host copy of an hour's offloaded KV). The saves' cuts, for the next."""
    running.front = tensors.pop("cache.front").tolist()
    shifts = tensors.pop("cache.prompt_shift", None)  # a checkpoint from before it: none moved
    if shifts is not None:
        if shifts.numel() != running.layers:
            raise PackError("the checkpoint is corrupted (cache.prompt_shift)")
        running.prompt_shift = shifts.tolist()
    running.streamed = int(tensors.pop("cache.streamed"))
    cuts = _checked_cuts(tensors.pop("cache.cuts"), running.streamed)
    for layer, entry in enumerate(running.cache.layers):
        name = f"cache.{layer}"
        index = from_index_runs(tensors.pop(f"{name}.index"))
        pristine = from_flag_runs(tensors.pop(f"{name}.pristine"))
        if len(pristine) != len(index):
            raise PackError(f"the checkpoint is corrupted ({name}'s entries do not fit)")
        running.index[layer], running.pristine[layer] = index, pristine
        heads = tensors.pop(f"{name}.heads", None)
        if heads is not None:
            if heads.dim() != 2 or heads.shape[1] != len(index):
                raise PackError(f"the checkpoint is corrupted ({name}'s heads do not fit)")
            running.heads[layer] = heads.to(torch.bool)
        served = pristine  # an index past the last cut has no piece: _placed refuses it
        pieces = {
            part: dict(_taken_pieces(tensors, f"{name}.stream.{part}."))
            for part in ("k", "v", "pos", "index")
        }
        where = (served, _placed(index, served, cuts, pieces["index"], name), name)
        parts = {
            part: _filled(tensors.pop(f"{name}.loose.{part}"), pieces[part], where, head)
            for part, head in (
                ("k", tensors.pop(f"{name}.head.k")),
                ("v", tensors.pop(f"{name}.head.v")),
                ("pos", None),
            )
        }
        entry.keys = parts["k"].unsqueeze(0).to(entry.keys)
        entry.values = parts["v"].unsqueeze(0).to(entry.values)
        running.positions[layer] = parts["pos"]
        kept, tails = {}, {}
        for kind in Archive.NAMES:
            prefix = f"{name}.archive.{kind}."
            kept[kind] = [piece for _, piece in _taken_pieces(tensors, prefix)]
            if f"{prefix}tail" in tensors:
                tails[kind] = tensors.pop(f"{prefix}tail")
        running.archive[layer] = Archive.restoring(kept, tails)
    return cuts


def _checked_cuts(cuts: torch.Tensor, streamed: int) -> list[int]:
    """The saves' cuts: rising stream indices, the last where the stream was at the last save."""
    values = cuts.tolist() if cuts.dim() == 1 and not cuts.is_floating_point() else None
    rising = bool(values) and values[0] > 0 and all(a < b for a, b in zip(values, values[1:]))
    if not rising or values[-1] != streamed:
        raise PackError("the checkpoint is corrupted (bad stream cuts)")
    return values


def _placed(index, served, cuts: list[int], piece_index: dict, name: str) -> list[tuple]:
    """Where each served entry's row is in the piece of its stream index: (piece number, the
    entries' rows in this layer, their rows in that piece), one sort for the whole layer. A
    checkpoint whose pieces do not hold every served entry is refused."""
    rows = served.nonzero().squeeze(1)
    rows = rows[torch.argsort(index[rows])]
    numbers, counts = torch.unique_consecutive(
        torch.bucketize(index[rows], torch.tensor(cuts), right=True), return_counts=True
    )
    placed = []
    for number, taken in zip(numbers.tolist(), torch.split(rows, counts.tolist())):
        held = piece_index.get(number, torch.empty(0, dtype=torch.long))
        at = torch.searchsorted(held, index[taken]).clamp(max=max(len(held) - 1, 0))
        if not len(held) or not torch.equal(held[at], index[taken]):
            raise PackError(f"the checkpoint is corrupted ({name}'s piece {number} does not fit)")
        placed.append((number, taken, at))
    return placed


def _filled(loose, pieces: dict, where: tuple, head=None) -> torch.Tensor:
    """One layer's K or V [H_kv, n, D] (after `head`, the prompt and front entries) or positions
    [P, n]: each served entry's row from its piece, the others from the loose rows in order."""
    served, placed, name = where
    front = 0 if head is None else head.shape[1]
    fits = int((~served).sum()) == loose.shape[1]
    if not fits or (head is not None and head.shape[::2] != loose.shape[::2]):
        raise PackError(f"the checkpoint is corrupted ({name} does not fit its entries)")
    out = loose.new_empty(loose.shape[0], front + len(served), *loose.shape[2:])
    if head is not None:
        out[:, :front] = head
    visual = out[:, front:]
    visual[:, ~served] = loose
    for number, taken, at in placed:
        if number not in pieces or pieces[number].shape[1] <= int(at.max()):
            raise PackError(f"the checkpoint is corrupted (a piece of {name} is missing)")
        visual[:, taken] = pieces[number][:, at].to(out)
    return out


def _taken_pieces(tensors: dict, prefix: str) -> list[tuple[int, torch.Tensor]]:
    """The tensors named `prefix`<number>, taken out of `tensors`, in order of number."""
    numbers = (k[len(prefix) :] for k in tensors if k.startswith(prefix))
    starts = sorted(int(n) for n in numbers if n.isdigit())
    return [(start, tensors.pop(f"{prefix}{start}")) for start in starts]


def blocks_tensors(blocks: list[Span], first: int = 0) -> dict[str, Sealed]:
    """Blockwise blocks, numbered from `first` (a block never changes once made): each one's
    K/V/positions concatenated (token-major, as a pack stores them) and representative, made only
    when it is written."""
    sealed = {}
    for i, block in enumerate(blocks, start=first):
        kv = sum(k.nbytes for k in block.keys)
        sealed[f"block.{i}.k"] = Sealed(lambda b=block: b.part(0), kv)
        sealed[f"block.{i}.v"] = Sealed(lambda b=block: b.part(1), kv)
        positions = sum(p.numel() for p in block.positions) * 8
        sealed[f"block.{i}.pos"] = Sealed(lambda b=block: b.part(2), positions)
        if block.representative is not None:
            sealed[f"block.{i}.rep"] = held(block.representative)
    return sealed


def block_rows(blocks: list[Span]) -> list[dict]:
    """What a checkpoint keeps of each block beside its tensors, as JSON rows."""
    return [
        {
            "counts": block.layer_counts,
            "granularity": block.granularity,
            "steps": list(block.steps) if block.steps else None,
            "time": list(block.time) if block.time else None,
            "extra": block.extra,
        }
        for block in blocks
    ]


def blocks_from(tensors: dict[str, torch.Tensor], rows: list[dict]) -> list[Span]:
    """The blocks a checkpoint saved, taken out of `tensors`: each layer's K, V and positions are
    views of the loaded tensors (the writer joins them again), not copies."""
    blocks = []
    for i, row in enumerate(rows):
        try:
            keys, values, positions = (
                split_layers(tensors.pop(f"block.{i}.{name}"), row["counts"])
                for name in ("k", "v", "pos")
            )
        except (KeyError, TypeError, RuntimeError):
            problem = f"the checkpoint is corrupted (block {i} does not fit its row)"
            raise PackError(problem) from None
        blocks.append(
            Span(
                name="",
                keys=keys,
                values=values,
                positions=positions,
                granularity=row["granularity"],
                steps=tuple(row["steps"]) if row["steps"] else None,
                time=tuple(row["time"]) if row["time"] else None,
                representative=tensors.pop(f"block.{i}.rep", None),
                extra=row["extra"],
            )
        )
    return blocks
