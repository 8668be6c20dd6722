"""Progress bars on stderr: transient, silenced by `-q`, and off a terminal not drawn at all (a bar
there leaves only a blank line)."""

from __future__ import annotations

from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mmkv_cli.cli.display import err_console


def encode_progress() -> Progress:
    return Progress(
        TextColumn("[bold]encode"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("frames"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,  # off a terminal a bar leaves only a blank line
    )


def counting_progress(label: str, unit: str) -> Progress:
    """A transient bar on stderr counting `unit` done of a total, with the time taken and an ETA
    (label and unit may name task fields: {task.description}, {task.fields[failed]})."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )


def eval_progress() -> Progress:
    return counting_progress("{task.description}", "clips")


@contextmanager
def questions_progress(total: int):
    """A bar on stderr over the questions answered, with an ETA; yields tick(answered)."""
    bar = counting_progress("questions", "")
    task = bar.add_task("questions", total=total)
    with bar:
        yield lambda done: bar.update(task, completed=done)
