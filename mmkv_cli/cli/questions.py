"""Questions for one load: from the command line, a file or stdin, one per line or JSONL.

A line is a question, or a JSON object {"question", "at"?, "id"?, "pack"?}; blank lines are
skipped. Every line is checked before any model is loaded, so a bad line 90 costs no answers to
lines 1-89.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import MAX_QUESTION_CHARS

MAX_QUESTIONS = 100_000
MAX_ID_CHARS = 256  # an id names a question in the answers: a label, echoed back
# a JSON line holds a question (at most MAX_QUESTION_CHARS, escaped: up to 6 characters each) and
# a few short fields; a longer line is refused before it is parsed
MAX_LINE_CHARS = 6 * MAX_QUESTION_CHARS + 8192
FIELDS = {"question", "at", "id", "pack"}


@dataclass(frozen=True)
class Question:
    text: str
    at: float | None = None  # overrides `--at` for this question
    id: str | int | None = None  # echoed in the answer's JSON
    pack: str | None = None  # the pack it asks (a file naming a pack per line); None: ask's PACK


BOM = "\ufeff"


def parse_lines(
    lines: Iterable[str], where: str, ignored: set[str] | None = None
) -> list[Question]:
    """Questions from text lines; `where` names the source in errors (a file name, "stdin").
    ignored: where a caller that reads other tools' files (synth's and eval's, with their answers
    and types) collects the keys it leaves out; None: an unknown key is refused."""
    out = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        out.append(
            _parse_json(text, f"{where}:{number}", ignored)
            if text.startswith("{")
            else _plain(text, f"{where}:{number}")
        )
        if len(out) > MAX_QUESTIONS:
            raise UsageError(f"{where}: more than {MAX_QUESTIONS} questions")
    return out


def _plain(text: str, where: str) -> Question:
    if len(text) > MAX_QUESTION_CHARS:
        raise UsageError(f"{where}: the question is longer than {MAX_QUESTION_CHARS} characters")
    return Question(text)


def _parse_json(text: str, where: str, ignored: set[str] | None) -> Question:
    if len(text) > MAX_LINE_CHARS:
        raise UsageError(f"{where}: a line longer than {MAX_LINE_CHARS} characters")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
    except RecursionError:
        raise UsageError(f"{where}: JSON nested too deep") from None
    if not isinstance(row, dict):
        raise UsageError(f"{where}: a JSON line must be an object with a 'question'")
    unknown = sorted(set(row) - FIELDS)
    if unknown and ignored is not None:
        ignored.update(unknown)
    elif unknown:
        raise UsageError(f"{where}: unknown key '{unknown[0]}' (question, at, id, pack)")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise UsageError(f"{where}: 'question' must be non-empty text")
    at = row.get("at")
    if at is not None and (
        isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at) or at < 0
    ):
        raise UsageError(f"{where}: 'at' must be a number of seconds >= 0")
    ident = row.get("id")
    if ident is not None and (
        isinstance(ident, bool)
        or not isinstance(ident, str | int)
        or (isinstance(ident, str) and len(ident) > MAX_ID_CHARS)
        or (isinstance(ident, int) and not -(2**63) <= ident < 2**63)
    ):
        raise UsageError(
            f"{where}: 'id' must be text of at most {MAX_ID_CHARS} characters or a 64-bit integer"
        )
    pack = row.get("pack")
    if pack is not None and (not isinstance(pack, str) or not pack.strip() or len(pack) > 4096):
        raise UsageError(f"{where}: 'pack' must be a path or URL")
    seconds = None if at is None else float(at)
    return Question(_plain(question.strip(), where).text, seconds, ident, pack)


def read_stdin() -> list[str]:
    if sys.stdin is None or sys.stdin.closed:
        raise UsageError("stdin is closed: '-' has no questions to read")
    try:
        return sys.stdin.read().removeprefix(BOM).splitlines()  # a byte-order mark is not text
    except UnicodeDecodeError:
        raise UsageError("stdin is not UTF-8 text") from None


def gather(
    arguments: list[str], file: str | None, ignored: set[str] | None = None
) -> list[Question]:
    """The questions of one `ask`: the arguments in order ('-' reads stdin, one per line), then
    the lines of `file` ('-': stdin). stdin can be read once. ignored: where the keys of other
    tools' files (synth's and eval's answers and types) are collected instead of refused."""
    if arguments.count("-") + (file == "-") > 1:
        raise UsageError("stdin can be read once: give '-' as one question or as --questions")
    out = []
    for argument in arguments:
        if argument == "-":
            out += parse_lines(read_stdin(), "stdin")
        elif argument.strip():
            out.append(_plain(argument.strip(), "the question"))
        else:
            raise UsageError("the question is empty")
    if file is not None:
        if file == "-":
            out += parse_lines(read_stdin(), "stdin", ignored)
        else:
            path = Path(file)
            try:
                lines = path.read_text(encoding="utf-8-sig").splitlines()  # a BOM is not text
            except FileNotFoundError:
                raise UsageError(f"{file}: no such questions file") from None
            except (OSError, UnicodeDecodeError) as err:
                raise UsageError(f"{file}: cannot read it as UTF-8 text ({err})") from None
            out += parse_lines(lines, file, ignored)
    if not out:
        raise UsageError("no question given (QUESTION..., '-' for stdin, or --questions FILE)")
    return out
