"""`mmkv live SOURCE -o PACK`: follow a stream still arriving, answer questions on the way
(registered on the app in app.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import typer

from mmkv_cli.cli.common import (
    DeviceOpt,
    DtypeOpt,
    KvBitsOpt,
    KvGroupOpt,
    ModelOpt,
    ReduceOpt,
    emit_json,
    load_options,
    method_names,
    run,
)
from mmkv_cli.cli.literal import plain
from mmkv_cli.core.errors import MediaError, UsageError
from mmkv_cli.core.options import Dtype, EncodeOptions, GenerationOptions


def live(
    source: str = typer.Argument(
        ...,
        help="'-' (a stream piped on stdin), a file still being written, rtsp:// rtmp:// udp:// "
        "http(s):// (MPEG-TS, HLS), or /dev/videoN.",
    ),
    output: str = typer.Option(
        ..., "--out", "-o", "--output", help="The .kvpack the memory goes to."
    ),
    method: str = typer.Option(
        "hermes", "--method", help="A streaming memory policy.", autocompletion=method_names
    ),
    budget_tokens: int | None = typer.Option(
        None, "--budget-tokens", help="Visual tokens of memory per layer (evicting methods)."
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="A share: refused live for evicting methods (no length to share)."
    ),
    fps: float | None = typer.Option(
        None, "--fps", help="Frames taken per second of stream (default: model preset)."
    ),
    questions: str | None = typer.Option(
        None,
        "--questions",
        help="JSONL of {question, id?, at?} (synth's and eval's files too; '-': stdin; "
        "/dev/tty: typed while the stream comes on stdin); default: typed at a prompt. A file's "
        "question without at is asked at the stream's end.",
    ),
    snapshot_every: float | None = typer.Option(
        None, "--snapshot-every", help="Publish the memory as a whole pack every N stream seconds."
    ),
    behind: str | None = typer.Option(
        None,
        "--behind",
        help="When the source outruns the encode: wait (pipes, files) or drop frames (others).",
    ),
    stall: float = typer.Option(10.0, "--stall", help="Seconds of silence that end the stream."),
    timeout: float = typer.Option(
        5.0, "--timeout", help="Seconds a network source has to connect, and for each read."
    ),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest answer, in tokens."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    kv_bits: float | None = KvBitsOpt,
    kv_group: int = KvGroupOpt,
    reduce: str | None = ReduceOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = typer.Option(False, "--json", help="Answers as JSON lines on stdout."),
) -> None:
    """Follow a live stream into a pack; each question is answered from the memory at its moment."""

    def body() -> None:
        from mmkv_cli.api.live import Follow
        from mmkv_cli.cli.display import err_console, out_console
        from mmkv_cli.media.live import LiveOptions

        if source == "-" and questions in (None, "-"):
            raise UsageError(
                "the stream comes on stdin: give the questions as --questions FILE, "
                "or --questions /dev/tty to type them"
            )
        if max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        options = EncodeOptions(
            method,
            budget,
            budget_tokens,
            force=force,
            kv_bits=kv_bits,
            kv_group=kv_group,
            reduce=reduce,
        )
        load = load_options(model, device, dtype)
        # a signal while the model loads is kept, not fatal: the follow stops as soon as it exists
        stopping, started = threading.Event(), []
        for stop in (signal.SIGTERM, signal.SIGINT):  # the final pack is written on the way out
            signal.signal(
                stop, lambda signum, frame: [stopping.set(), *(f.stop() for f in started)]
            )
        from mmkv_cli.serve.client import clear_status, status

        status("loading the model ...")  # on a terminal: seconds pass before the first frame
        try:
            following = Follow(
                source,
                output,
                options,
                LiveOptions(fps=fps, behind=behind, stall_s=stall, timeout_s=timeout),
                load=load,
                snapshot_every=snapshot_every,
                generation=GenerationOptions(max_new_tokens),
                on_answer=lambda record: _show(record, as_json, out_console),
                on_ready=lambda event: err_console.print(
                    plain(
                        f"ready: {source} gave its first frame {event['after_s']:.1f} s after "
                        "the start; questions are answered from here"
                    ),
                    soft_wrap=True,
                ),
            )
        finally:
            clear_status()
        feeder = threading.Thread(
            target=_feed, args=(following, questions), name="mmkv-live-questions", daemon=True
        )
        started.append(following)
        chosen = following.choice.budget
        if budget_tokens is None and chosen is not None and chosen.tokens is not None:
            err_console.print(
                f"{method} keeps {chosen.tokens:,} visual tokens a layer (its default; "
                "--budget-tokens N for another memory)",
                highlight=False,
                soft_wrap=True,
            )
        if stopping.is_set():
            raise MediaError(f"stopped before {source} gave a frame: no pack written")
        feeder.start()
        done = following.run()
        err_console.print(
            plain(
                f"wrote {done['path']}: {done['frames']} frames to {done['moment']:.2f} s "
                f"({done['stopped']}; {done['dropped']} dropped, {done['snapshots']} snapshots)"
            ),
            soft_wrap=True,  # one line however long the path: a log reads it as one
        )
        if done["error"]:
            raise MediaError(f"{done['error']} (the memory so far is in {done['path']})")

    run(body)


def _feed(following, questions: str | None) -> None:
    """Questions into the follow, a line at a time, as they come: a bad line is one line on stderr
    and the stream goes on."""
    from mmkv_cli.api.live import LiveQuestion
    from mmkv_cli.cli.display import err_console
    from mmkv_cli.cli.questions import BOM, parse_lines

    if questions is None:
        lines, where = _typed(), "prompt"
    elif questions == "-":
        if sys.stdin is None or sys.stdin.closed:
            err_console.print(
                "error: stdin is closed: '-' has no questions to read", highlight=False
            )
            return
        lines, where = sys.stdin, "stdin"
    else:
        try:
            lines, where = open(questions, encoding="utf-8-sig"), questions  # noqa: SIM115
        except OSError as err:
            err_console.print(plain(f"error: {questions}: {err.strerror}"))
            return
    ignored: set[str] = set()  # keys of other tools' files (answers, types), told once each
    # a file's question without a moment is asked of the whole stream, as eval asks it; typed or
    # piped, it is asked now
    at_end = where not in ("prompt", "stdin") and os.path.isfile(questions or "")
    told = False
    for number, line in enumerate(lines, 1):
        line = line.removeprefix(BOM) if number == 1 else line  # a BOM on a pipe
        try:
            known = set(ignored)
            for q in parse_lines([line], f"{where}:{number}", ignored):
                following.ask(LiveQuestion(q.text, q.id, q.at, at_end=at_end and q.at is None))
                if at_end and q.at is None and not told:
                    told = True
                    err_console.print(
                        plain(f"note: {where}: a question without 'at' is answered at the end")
                    )
            if ignored - known:
                err_console.print(
                    plain(
                        f"warning: {where}: ignored the key(s) "
                        f"{', '.join(sorted(ignored - known))} (live reads question, id and at)"
                    )
                )
        except UsageError as err:
            err_console.print(plain(f"error: {err}"))


def _typed():
    while True:
        try:
            yield input()
        except EOFError:
            return


def _show(record: dict, as_json: bool, console) -> None:
    """One answer a line: which question (its id, else its words), the moment it saw, the answer."""
    if as_json:
        emit_json(record)
        return
    asked = record["id"] if record.get("id") is not None else record["question"]
    if "error" in record:
        console.print(plain(f"[{asked}] error: {record['error']}"), soft_wrap=True)
        return
    note = f"; {record['note']}" if record.get("note") else ""
    console.print(
        plain(  # "[q1 @ 2.00 s]" is not a style
            f"[{asked} @ {record['moment']:.2f} s] {record['answer']}  "
            f"(ttft {record['ttft_s']:.2f} s, {record['behind_s']:.1f} s behind{note})"
        ),
        soft_wrap=True,
    )
