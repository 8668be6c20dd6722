"""Where a question's block rows land on their way from the file to the model's device.

From pageable memory a copy to a GPU is synchronous: the driver stages it through a pinned buffer
of its own while the host waits, so a read of a 7B pack alternated between the disk and the bus.
Rows read into page-locked (pinned) buffers are sent with one asynchronous copy each: the host
reads the next group of layers while the last group crosses. A group is about `stage_bytes`, so
the first copy starts early and the pinned memory in flight stays bounded by the pack, not the
video. On the CPU the buffers are ordinary memory and sending them is the identity.
"""

from __future__ import annotations

import numpy as np

from mmkv_cli.lazy import torch

# K/V bytes read per group of layers before it is sent to the device (at 7B in bf16 about a layer
# of 512 frames): large enough that a group's preads coalesce, small enough that copying overlaps
STAGE_BYTES = 64 << 20


class Staging:
    """Host buffers for rows bound for `device` (pinned when it is a GPU), and their sending."""

    def __init__(self, device=None, stage_bytes: int | None = None) -> None:
        # the caller's own object where it is one (tests follow the model's device by it)
        self.device = device if isinstance(device, torch.device) else torch.device(device or "cpu")
        self.pinned = self.device.type == "cuda"
        self.stage_bytes = max(1, STAGE_BYTES if stage_bytes is None else stage_bytes)

    def buffer(self, rows: int, row_shape: tuple, np_dtype, torch_dtype: str):
        """An empty [rows, *row_shape] buffer: the numpy array a pread fills, and the same bytes
        as a torch tensor of `torch_dtype` (bfloat16 is read as uint16: numpy has none)."""
        shape = (rows, *row_shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(np_dtype).itemsize
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        array = raw.numpy().view(np_dtype).reshape(shape)
        return array, raw.view(getattr(torch, torch_dtype)).view(shape)

    def send(self, tensor):
        """`tensor` on the device; from pinned memory the host does not wait for the copy (the
        caching host allocator keeps the buffer until the copy is done)."""
        return tensor.to(self.device, non_blocking=True)

    def groups(self, layer_bytes: list[int]) -> list[range]:
        """Consecutive layers in groups of about `stage_bytes` (a layer larger is a group alone)."""
        out, first, held = [], 0, 0
        for layer, size in enumerate(layer_bytes):
            if layer > first and held + size > self.stage_bytes:
                out.append(range(first, layer))
                first, held = layer, 0
            held += size
        if layer_bytes:
            out.append(range(first, len(layer_bytes)))
        return out
