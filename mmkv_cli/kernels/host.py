"""Bringing device tensors to the host without stopping the device more than once.

Each `.cpu()` of a CUDA tensor waits for every kernel queued before it. A policy that reads a score
per layer waited once per layer per chunk (28 at 7B); `host_all` brings a whole list across in
one copy per dtype. `HostCopies` sends KV that is leaving the device (offloaded, or kept for the
pack) into pinned host memory on a side stream, so the next chunk's forward runs while it copies;
`settle` is the one wait, before the host reads what was sent. On the CPU both hand back the
tensors themselves.
"""

from __future__ import annotations

from mmkv_cli.core.lazy import torch


def host_all(tensors: list) -> list:
    """`tensors` (on one device) on the host, in one transfer per dtype: one wait, not one each."""
    out: list = [None] * len(tensors)
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for chosen in by_dtype.values():
        parts = [tensors[i] for i in chosen]
        flat = torch.cat([p.reshape(-1) for p in parts]).cpu()
        pieces = flat.split([p.numel() for p in parts])
        for i, piece, part in zip(chosen, pieces, parts):
            out[i] = piece.view(part.shape)
    return out


class HostCopies:
    """Copies to pinned host memory on a side stream of `device`'s (CUDA); the tensors themselves
    on the CPU. What `host` returns may be read only after `settle`."""

    def __init__(self, device) -> None:
        device = torch.device(device)
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._pending = False

    def host(self, tensor, own: bool = False):
        """`tensor` on the host; own: in memory of its own on the CPU too (a view would keep the
        whole tensor it was cut from alive)."""
        if not self._cuda or tensor.device.type != "cuda":  # the CPU: the tensor itself
            if own:
                return tensor.clone(memory_format=torch.contiguous_format)
            return tensor.to("cpu", non_blocking=tensor.device.type == "cpu")
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))  # after it is made
        with torch.cuda.stream(self._stream):
            out.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # its memory is not reused before the copy is done
        self._pending = True
        return out

    def mark(self):
        """What to wait on (another thread may) for the copies sent so far: a CUDA event, or None
        where there is nothing to wait for."""
        if not self._pending:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def settle(self) -> None:
        """Wait for every copy sent: the host may read them after this."""
        if self._pending:
            self._stream.synchronize()
            self._pending = False
