"""Verdicts on what a question read, taken with its first token rather than as each read ends.

NaN/Inf verdicts on K/V decoded on the device: a quantized context is decoded where it is used;
reading its verdict as soon as it is made would stop the host once more before the first token. A
question reads them with its first token instead (one transfer for both).

Checksums still being computed: a read of large digest units bound for the model (ReKV's layers
read inside the forward, a context read whole) hands its rows over at once and leaves its hashing
to finish on the hashing threads while the forward runs; the first token waits for it.

Either way the pack is refused then, before any token is shown."""

from __future__ import annotations

from collections.abc import Callable

from mmkv_cli.core.errors import PackError
from mmkv_cli.core.lazy import torch


def finite_flag(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One bool tensor, on the tensors' device, saying no NaN or Inf is in any of them (None: no
    float values to check). One min/max pass each (NaN carries through both), many times faster
    than isfinite over every element (docs/measurements.md)."""
    found = [
        torch.isfinite(torch.stack(torch.aminmax(t)))
        for t in tensors
        if t.numel() and t.is_floating_point()
    ]
    return torch.cat(found).all() if found else None


class LaterVerdicts:
    """The verdicts of the reads made while a question is built, for its first token to read."""

    def __init__(self, path: str) -> None:
        self.path = path
        # each read's verdict, its blocks, and what names the one at fault (asked only when the
        # verdict fails)
        self._reads: list[tuple[torch.Tensor, list[str], Callable[[], str] | None]] = []
        self._checks: list[Callable[[], None]] = []

    def defer(self, check: Callable[[], None]) -> None:
        """A read's checksums, still being computed: `check()` waits for them and refuses the pack
        (PackError) where they differ."""
        self._checks.append(check)

    def check_reads(self) -> None:
        """Wait for every deferred read's checksums, in the order read: the first that fails
        refuses the pack."""
        checks, self._checks = self._checks, []
        for check in checks:
            check()

    def add(
        self, flag: torch.Tensor | None, names: list[str], at_fault: Callable[[], str] | None = None
    ) -> None:
        """A read's verdict over its blocks `names`; at_fault(): the block whose K/V are not
        finite, found (by reading them again) only if the verdict fails."""
        if flag is not None:
            self._reads.append((flag, names, at_fault))

    def pending(self) -> torch.Tensor | None:
        """Every verdict in one bool tensor, not read (None: none to read)."""
        return torch.stack([flag for flag, *_ in self._reads]).all() if self._reads else None

    def settle(self, finite: bool) -> None:
        """Refuse the pack unless `finite`, the pending verdict as read."""
        reads, self._reads = self._reads, []
        if finite:
            return
        for flag, names, at_fault in reads:  # a refusal: each verdict looked at
            if not bool(flag):
                listed = ", ".join(names[:3]) + ", ..." * (len(names) > 3)
                shown = at_fault() if at_fault else listed
                raise PackError(f"{self.path} is corrupted (NaN or Inf in the K/V of {shown})")
        raise PackError(f"{self.path} is corrupted (NaN or Inf in the K/V read)")
