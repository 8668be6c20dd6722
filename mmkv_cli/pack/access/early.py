"""A pack written while its blocks are still being made.

When every block's shape is known before the encode starts (a memory that keeps every token, one
block per step: `full`, `rekv`, `streamingtom`), the file's layout is too: every tensor's place in
it. Each block is then written to its place (quantized and hashed) on a thread of its own as soon
as the encode has made it, so the encode's GPU work and the write of GBs of KV run side by side,
and what is left at the end is the small tensors and the head. The head's final length is known
only then (its stats): it is given room, padded with spaces. A block that comes otherwise than
planned, or a head that outgrows its room, makes the pack be written the ordinary way from the
blocks kept; the result is the same pack but for the head's padding.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mmkv_cli.pack.access.block_writing import write_blocks
from mmkv_cli.pack.access.writer import (
    DIGEST,
    block_starts,
    finish_file,
    plan_pack,
    publish,
    temp_path,
    write_failed,
    write_pack,
)
from mmkv_cli.pack.io.atomic import check_writable, sweep_stale
from mmkv_cli.pack.quantized.quant import QuantSpec
from mmkv_cli.pack.schema.format import BlockShape, Span
from mmkv_cli.pack.schema.header import PackHeader
from mmkv_cli.pack.schema.stored import block_shape

# bytes of head beyond the provisional one: the final header differs in its figures (the encode's
# seconds, its peak memory), a few dozen bytes
HEAD_SLACK = 1024
# blocks' K/V bytes below which a pack is written at the end: its write is over before a thread
# of its own would pay (at 7B, about six frames)
EARLY_BYTES = 64 << 20


def worth_writing_early(shapes: Sequence[BlockShape], first: Span) -> bool:
    """Whether the blocks of `shapes` (as wide as `first`) hold EARLY_BYTES of K/V or more."""
    tokens = sum(sum(shape.layer_counts) for shape in shapes)
    row = first.keys[0].shape[0] * first.keys[0].shape[2] * first.keys[0].element_size()
    return 2 * row * tokens >= EARLY_BYTES


class Unplanned(Exception):
    """A block came otherwise than the plan said: the pack is written the ordinary way."""


def same_shape(made: BlockShape, planned: BlockShape) -> bool:
    """What decides a block's rows and places in the file: all but the representative's values."""
    keep = ("granularity", "steps", "time", "layer_counts", "shared_positions")
    if any(getattr(made, name) != getattr(planned, name) for name in keep):
        return False
    mine, theirs = made.representative, planned.representative
    if mine is None or theirs is None:
        return mine is theirs
    return mine.shape == theirs.shape and mine.dtype == theirs.dtype


class EarlyPack:
    """The pack at `path` planned from a provisional header, prefix and suffix (their values may
    change, not their sizes) and every block's shape; `first`: a block of the blocks' dtype and
    widths. Blocks come through `add` in table order; `finish` writes the rest and publishes it."""

    def __init__(
        self,
        path: Path,
        header: PackHeader,
        prefix: Span,
        shapes: Sequence[BlockShape],
        first: Span,
        suffix: Span,
        *,
        force: bool = False,
        quant: QuantSpec | None = None,
        reps_space: str = "pre_rope",
        series: dict[str, list] | None = None,
    ) -> None:
        check_writable(path, force)
        self.path, self.force, self.quant = path, force, quant or QuantSpec()
        self.shapes = list(shapes)
        self.plan = plan_pack(header, prefix, self.shapes, first, suffix, quant, reps_space, series)
        provisional = len(self.plan.head(None))
        self.room = -(-(provisional - 8 + HEAD_SLACK) // 8) * 8  # the directory's bytes
        self.data_start = 8 + self.room
        self.blocks: list[Span] = []  # every block made: the ordinary write needs them again
        self._made: queue.Queue[Callable[[], list[Span]] | None] = queue.Queue()
        self._keys = self.plan.key_scales()
        self._ends: list[int] = []
        self._digests: list[bytes] = []
        self._failed: BaseException | None = None
        self._ended = False  # the writer's thread has taken `_stop`'s None
        sweep_stale(path)
        self._tmp = temp_path(path)
        try:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed by finish or abandon)
        except OSError as err:
            raise write_failed(path, err) from err
        self._thread = threading.Thread(target=self._run, name="mmkv-pack-writer", daemon=True)
        self._thread.start()

    def add(self, make: Callable[[], list[Span]]) -> None:
        """The next blocks, in table order, made by `make()` on the writer's thread (which may
        wait there for copies from a GPU without stopping the encode)."""
        self._made.put(make)

    def finish(
        self,
        header: PackHeader,
        prefix: Span,
        suffix: Span,
        reps_space: str = "pre_rope",
        series: dict[str, list] | None = None,
    ) -> int:
        """The pack published at its path with the final header, prefix and suffix; its size."""
        self._stop()
        try:
            failed = self._failed
            if isinstance(failed, OSError):
                raise write_failed(self.path, failed)
            if failed is not None and not isinstance(failed, Unplanned):
                raise failed
            shapes = [block_shape(block) for block in self.blocks]
            plan = plan_pack(header, prefix, shapes, self.blocks[0] if self.blocks else None,
                             suffix, self.quant, reps_space, series)  # fmt: skip
            fits = len(plan.head(None, self.room)) == self.data_start
            if failed is None and fits and plan.entries == self.plan.entries:
                try:
                    finish_file(self._file, self.path, plan, self.data_start, self.room,
                                self._ends, self._digests, self._keys)  # fmt: skip
                    self._file.close()
                    publish(self._tmp, self.path, self.force)
                except OSError as err:
                    raise write_failed(self.path, err) from err
                return self.path.stat().st_size
        finally:
            self._discard()
        return write_pack(self.path, header, prefix, self.blocks, suffix, self.force, self.quant,
                          reps_space, series=series)  # fmt: skip

    def abandon(self) -> None:
        """The encode failed: the writer stopped and the partial file removed."""
        self._stop()
        self._discard()

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._made.put(None)
            self._thread.join()

    def _discard(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def _makers(self) -> Iterator[Callable[[], list[Span]]]:
        """What `add` was given, until `_stop` (once: later calls yield nothing)."""
        while not self._ended:
            make = self._made.get()
            if make is None:
                self._ended = True
                return
            yield make

    def _incoming(self) -> Iterator[Span]:
        """The blocks as they are made, each checked against its planned shape."""
        for make in self._makers():
            for block in make():
                self.blocks.append(block)
                at = len(self.blocks) - 1
                if at >= len(self.shapes) or not same_shape(block_shape(block), self.shapes[at]):
                    raise Unplanned(block.name)
                yield block
        if len(self.blocks) != len(self.shapes):
            raise Unplanned(f"{len(self.blocks)} blocks, not {len(self.shapes)}")

    def _run(self) -> None:
        """On the writer's thread: each block written as it comes; after a failure the rest are
        still made and kept, for the ordinary write (or to be let go)."""
        try:
            starts = block_starts(self.plan, self.data_start)
            self._ends, self._digests = write_blocks(
                self._file, self._incoming(), starts, self._keys, DIGEST, self.plan.digest_layers
            )
        except BaseException as err:  # noqa: BLE001 (handed to finish, on the caller's thread)
            self._failed = err
            try:
                for make in self._makers():
                    self.blocks += make()
            except BaseException as late:  # noqa: BLE001
                self._failed = late
                for _ in self._makers():  # what is left is let go
                    pass
