"""Where a question's block rows land on their way from the file to the model's device.

From pageable memory a copy to a GPU is synchronous: the driver stages it through a pinned buffer
of its own while the host waits. Rows read into page-locked (pinned) buffers are sent with
asynchronous copies instead. A large read bound for a GPU goes in groups of about `STAGE_BYTES`
cut in file order (whole blocks, every layer of them: the file keeps a block's layers together,
so each group is read by preads that run through the file, not strided across it); each group's
rows are copied into their places in every layer's tensor on the device while the next group is
read. On the CPU there is nothing to overlap: one read, each layer a view of its buffer.
"""

from __future__ import annotations

import numpy as np

from mmkv_cli.core.lazy import torch

# K/V bytes read per group before it is sent to a GPU: large enough that a group's preads run long,
# small enough that the copies overlap the reading (at 7B, about six frames of K/V)
STAGE_BYTES = 64 << 20
# the same on the CPU, where a group would only add a copy into place (None: one read)
HOST_STAGE_BYTES: int | None = None
# host buffers of layers after one another share an allocation of at least this (Staging.buffers)
HOST_JOIN_BYTES = 32 << 20


class Staging:
    """Host buffers for rows bound for `device` (pinned when it is a GPU), and their sending."""

    def __init__(self, device=None) -> None:
        # the caller's own object where it is one (tests follow the model's device by it)
        self.device = device if isinstance(device, torch.device) else torch.device(device or "cpu")
        self.pinned = self.device.type == "cuda"
        self.stage_bytes = STAGE_BYTES if self.pinned else HOST_STAGE_BYTES

    def buffers(self, counts: list[int], row_shape: tuple, np_dtype, torch_dtype: str) -> list:
        """Empty [counts[i], *row_shape] buffers: for each, the numpy array a pread fills and the
        same bytes as a torch tensor of `torch_dtype` (bfloat16 is read as uint16: numpy has
        none). Those of no rows share one.

        On the host, numpy's: it asks for huge pages for an allocation of 4 MiB or more, and a
        pread into fresh memory then faults a page in each 2 MiB instead of each 4 KiB (a
        HERMES-shaped context's layers are about 4 MiB a part at 7B). Layers after one another
        share an allocation of at least HOST_JOIN_BYTES; a larger layer has its own, so a
        caller letting go of each layer as it joins it holds at most one more group."""
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        join = 0 if self.pinned else HOST_JOIN_BYTES  # pinned: the caching allocator's, reused
        made: list = [None] * len(counts)
        blank, group, held = None, [], 0  # group: layers waiting to share `held` rows
        for layer, rows in enumerate(counts):
            if rows:
                group.append(layer)
                held += rows
            else:
                blank = blank or self._made(0, row_shape, np_dtype, torch_dtype)
                made[layer] = blank
            if group and (layer == len(counts) - 1 or held * row_bytes >= join):
                array, tensor = self._made(held, row_shape, np_dtype, torch_dtype)
                at = 0
                for g in group:  # each layer a view of its rows of the allocation
                    made[g] = array[at : at + counts[g]], tensor[at : at + counts[g]]
                    at += counts[g]
                group, held = [], 0
        return made

    def _made(self, rows: int, row_shape: tuple, np_dtype, torch_dtype: str):
        """One allocation of [rows, *row_shape]: (numpy array, torch tensor) over the same bytes,
        pinned where bound for a GPU."""
        shape = (rows, *row_shape)
        if not self.pinned:
            array = np.empty(shape, np_dtype)
            return array, torch.from_numpy(array).view(getattr(torch, torch_dtype))
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        array = raw.numpy().view(np_dtype).reshape(shape)
        return array, raw.view(getattr(torch, torch_dtype)).view(shape)

    def send(self, tensor):
        """`tensor` on the device; from pinned memory the host does not wait for the copy (the
        caching host allocator keeps the buffer until the copy is done)."""
        return tensor.to(self.device, non_blocking=True)

    def in_groups(self, nbytes: int) -> bool:
        """Whether a read of `nbytes` goes in groups (bound for a GPU, and large)."""
        return self.stage_bytes is not None and nbytes > self.stage_bytes

    def groups(self, rows: np.ndarray, firsts, ends, row_bytes: int) -> list[list[tuple]] | None:
        """The read cut in file order into groups of about `stage_bytes`: for each group, each
        layer's (start, stop) in its own rows (rows[firsts[l]:ends[l]], ascending in the file).
        None: one read (small, on the CPU, or a layer's rows out of file order)."""
        if not self.in_groups(len(rows) * row_bytes):
            return None
        layers = [rows[a:b] for a, b in zip(firsts, ends)]
        if any(np.any(np.diff(layer) <= 0) for layer in layers):
            return None
        ordered = np.sort(rows)
        step = max(1, self.stage_bytes // max(1, row_bytes))
        cuts = [*ordered[step::step].tolist(), int(ordered[-1]) + 1]  # each group's first row after
        out, low = [], int(ordered[0])
        for high in cuts:
            out.append(
                [
                    (int(np.searchsorted(layer, low)), int(np.searchsorted(layer, high)))
                    for layer in layers
                ]
            )
            low = high
        return out
