"""mmkv's log records on the terminal, and the answer's line they must not cut: records that come
while an answer streams on stdout wait for its end; every record's control characters are made
visible (a logged path or request line may come from outside)."""

from __future__ import annotations

import logging
import sys

from mmkv_cli.cli.display import err_console, error_console
from mmkv_cli.cli.literal import visible


def show_logs(level: int, quiet: bool) -> None:
    """mmkv's log records at `level` and above on stderr through rich's handler; quiet: the notes
    and progress bars go too, leaving answers and errors."""
    from rich.logging import RichHandler

    err_console.quiet = quiet
    handler = RichHandler(
        console=error_console,
        show_time=level <= logging.DEBUG,
        show_path=False,
        markup=False,
        rich_tracebacks=False,
    )
    handler.setFormatter(VisibleFormatter("%(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger("mmkv")
    root.handlers = [h for h in root.handlers if not isinstance(h, HeldWhileAnswering)]
    root.handlers.append(HeldWhileAnswering(handler))
    root.setLevel(level)


class HeldWhileAnswering(logging.Handler):
    """Records that come while an answer's line streams on stdout wait for its end: on one
    terminal they would land in the middle of the answer."""

    held: list[tuple[logging.Handler, logging.LogRecord]] = []
    answering = False

    def __init__(self, inner: logging.Handler):
        super().__init__()
        self.inner = inner

    def emit(self, record: logging.LogRecord) -> None:
        if HeldWhileAnswering.answering:
            HeldWhileAnswering.held.append((self.inner, record))
        else:
            self.inner.handle(record)


def answer_piece(piece: str) -> None:
    """A piece of the answer streaming on stdout (the line is held open until answer_end)."""
    HeldWhileAnswering.answering = True
    sys.stdout.write(piece)
    sys.stdout.flush()


def answer_broken() -> None:
    """An answer cut by an error: its line ends, so the error starts a line of its own."""
    if HeldWhileAnswering.answering:
        answer_end()


def answer_end() -> None:
    """The answer's line ended; the records held meanwhile shown."""
    sys.stdout.write("\n")
    sys.stdout.flush()
    HeldWhileAnswering.answering = False
    held, HeldWhileAnswering.held = HeldWhileAnswering.held, []
    for handler, record in held:
        handler.handle(record)


class VisibleFormatter(logging.Formatter):
    """A record's line with its control characters made visible: a logged path or request line
    may come from outside."""

    def format(self, record) -> str:
        return visible(super().format(record))
