"""Host storage for what a streaming policy moves out of attention but keeps for the pack (ReKV's
offloaded KV: at an hour of video, GBs), filled a chunk at a time in large slabs.

One small tensor per offload, long-lived and interleaved with each chunk's short-lived working
tensors, left glibc's heap unable to reuse or return its holes: ReKV's RSS grew 14 MB a chunk for
3 MB of KV (rehearsal 0.5B, one layer). A slab larger than glibc's largest mmap threshold (32 MB) is
a mapping of its own, its untouched pages cost nothing, and freeing it returns it whole.

A checkpoint saves an archive as whole pieces of PIECE entries, each written once (what is archived
never changes), plus the tail after the last whole piece; slabs hold whole pieces, so every piece
is a view of one slab.
"""

from __future__ import annotations

from mmkv_cli.core.lazy import torch

SLAB_BYTES = 64 << 20
PIECE = 8192  # entries a checkpoint writes once as one piece (K or V of 8 MB at 7B in bf16)


class Column:
    """Tensors appended along `dim`, copied into host slabs of about `slab_bytes` each."""

    def __init__(self, dim: int, slab_bytes: int = SLAB_BYTES, unit: int = 1):
        self.dim = dim
        self.slab_bytes = slab_bytes
        self.unit = unit  # a slab holds a whole number of these many entries
        self.slabs: list[torch.Tensor] = []
        self.filled = 0  # entries along dim in the last slab
        self._copied = None  # a CUDA event after the last copy into the slabs, until it is read

    def __len__(self) -> int:
        if not self.slabs:
            return 0
        return sum(s.shape[self.dim] for s in self.slabs[:-1]) + self.filled

    def append(self, tensor: torch.Tensor) -> None:
        done, count = 0, tensor.shape[self.dim]
        while done < count:
            if not self.slabs or self.filled == self.slabs[-1].shape[self.dim]:
                self.slabs.append(self._slab(tensor))
                self.filled = 0
            slab = self.slabs[-1]
            take = min(count - done, slab.shape[self.dim] - self.filled)
            # from a GPU into pinned slabs without a wait; the host reads them after ready()
            slab.narrow(self.dim, self.filled, take).copy_(
                tensor.narrow(self.dim, done, take), non_blocking=True
            )
            self.filled += take
            done += take
        if tensor.is_cuda and count:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(tensor.device))

    def ready(self) -> None:
        """Wait for the copies still on their way from the GPU (once, when first read)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def _slab(self, like: torch.Tensor) -> torch.Tensor:
        per_entry = like.element_size() * like.numel() // max(1, like.shape[self.dim])
        shape = list(like.shape)
        room = self.slab_bytes // max(1, per_entry)
        shape[self.dim] = max(self.unit, room // self.unit * self.unit)
        return torch.empty(shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)

    def entries(self, start: int, stop: int) -> torch.Tensor:
        """Entries [start, stop) along dim: a view where they lie in one slab, else joined."""
        views, offset = [], 0
        for part in self.parts():
            count = part.shape[self.dim]
            first, last = max(start, offset), min(stop, offset + count)
            if first < last:
                views.append(part.narrow(self.dim, first - offset, last - first))
            offset += count
        return views[0] if len(views) == 1 else torch.cat(views, dim=self.dim)

    def adopt(self, parts: list[torch.Tensor]) -> None:
        """Take `parts` (what parts() gave, loaded back) as this empty column's slabs, without
        copying them; the next append starts a slab of its own."""
        self.slabs = list(parts)
        self.filled = self.slabs[-1].shape[self.dim] if self.slabs else 0

    def parts(self) -> list[torch.Tensor]:
        """The filled part of each slab, as views."""
        self.ready()
        if not self.slabs:
            return []
        last = self.slabs[-1].narrow(self.dim, 0, self.filled)
        return [*self.slabs[:-1], last]

    def fork(self) -> Column:
        """A column sharing these entries (no copy): what either appends after goes to a slab of
        its own, so neither sees the other's."""
        fork = Column(self.dim, self.slab_bytes, self.unit)
        fork.adopt(self.parts())
        return fork

    def take(self) -> list[torch.Tensor]:
        """parts(), handing them over: the column is empty afterwards."""
        parts = self.parts()
        self.slabs, self.filled = [], 0
        return parts


class Archive:
    """One layer's archived entries: K, V [H_kv, n, D], positions [P, n], stream indices [n]."""

    NAMES = ("k", "v", "pos", "index")

    def __init__(self, slab_bytes: int = SLAB_BYTES, piece: int | None = None):
        self.piece = piece or PIECE
        self.columns = {
            name: Column(-2 if name in ("k", "v") else -1, slab_bytes, self.piece)
            for name in self.NAMES
        }

    def __len__(self) -> int:
        return len(self.columns["index"])

    def add(self, keys, values, positions, index) -> None:
        for name, tensor in zip(self.NAMES, (keys, values, positions, index)):
            self.columns[name].append(tensor)

    def parts(self) -> dict[str, list[torch.Tensor]]:
        return {name: column.parts() for name, column in self.columns.items()}

    def fork(self) -> Archive:
        """An archive sharing these entries, without copying them (Column.fork)."""
        fork = Archive(piece=self.piece)
        fork.columns = {name: column.fork() for name, column in self.columns.items()}
        return fork

    def take(self) -> dict[str, list[torch.Tensor]]:
        return {name: column.take() for name, column in self.columns.items()}

    def take_joined(self, live: tuple) -> tuple:
        """Everything archived followed by `live` (K, V, positions, index), each joined along its
        column; the archive empties. With nothing archived, `live` as it is (no copy)."""
        if not len(self):
            return live
        parts = self.take()
        return tuple(
            torch.cat([*parts[name], tensor], dim=self.columns[name].dim)
            for name, tensor in zip(self.NAMES, live)
        )

    def pieces(self) -> tuple[dict[str, dict[int, torch.Tensor]], dict[str, torch.Tensor]]:
        """What a checkpoint saves: each column's whole pieces by their first entry (views), and
        the entries after the last whole piece (the tail; none when there are none)."""
        whole = len(self) // self.piece * self.piece
        pieces = {
            name: {
                start: column.entries(start, start + self.piece)
                for start in range(0, whole, self.piece)
            }
            for name, column in self.columns.items()
        }
        tails = {}
        if whole < len(self):
            tails = {name: c.entries(whole, len(self)) for name, c in self.columns.items()}
        return pieces, tails

    @classmethod
    def restoring(
        cls,
        pieces: dict[str, list[torch.Tensor]],
        tails: dict[str, torch.Tensor],
        piece: int | None = None,
    ) -> Archive:
        """An archive of what pieces() gave, loaded back from a checkpoint: the pieces (in order)
        become its slabs without a copy, the tail is copied into a fresh slab, so the slabs go on
        holding whole pieces."""
        archive = cls(piece=piece)
        for name, column in archive.columns.items():
            column.adopt(pieces.get(name, []))
            if name in tails:
                column.append(tails[name])
        return archive
