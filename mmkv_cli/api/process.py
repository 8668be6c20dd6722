"""What this process holds across calls: the backbones `mmkv.ask` and `mmkv.encode` share (two: a
model and another), loaded once for every later `shared` call."""

from __future__ import annotations

from mmkv_cli.backbones.held import HeldBackbones

PROCESS_BACKBONES = HeldBackbones(2)


def unload() -> None:
    """Let go of the backbones this process holds for `shared` calls (their memory is freed once
    nothing else refers to them)."""
    PROCESS_BACKBONES.clear()
