"""One eval question and how its answer is scored. Scoring is deterministic and local (no judge
model): the option letter for multiple choice; otherwise by the answer's format."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from mmkv_cli.core.errors import UsageError

LETTERS = "ABCDEFGHIJ"
NOT_ANSWERABLE = "not answerable"
# how an answer is compared with the gold one (multiple choice is "letter" whatever is given)
FORMATS = ("text", "int", "float", "list", "none")
FLOAT_TOLERANCE = 0.01  # relative; MMLongBench-Doc's float answers also match as a percentage


@dataclass(frozen=True)
class Item:
    video: str  # absolute path of the media (a video, or a PDF for documents)
    question: str
    answer: str  # normalised text, an option letter, a number, or "not answerable"
    options: tuple[str, ...] = ()
    at: float | None = None  # the question's moment (`ask --at`)
    type: str = "all"
    format: str = "text"  # FORMATS: how a prediction is compared (options: by letter)
    split: str | None = None  # the benchmark's part (OVO-Bench: backward, real-time, forward)

    @property
    def key(self) -> str:
        return json.dumps([self.video, self.question, self.at])


def normalise(text: str) -> str:
    text = re.sub(r"[^a-z0-9 ]+", " ", str(text).lower())
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def option_letter(answer, options: list[str]) -> str:
    """The gold option as a letter: given as a letter, an index or the option's text."""
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(options):
        return LETTERS[answer]
    text = str(answer).strip()
    if len(text) == 1 and text.upper() in LETTERS[: len(options)]:
        return text.upper()
    matches = [i for i, o in enumerate(options) if normalise(o) == normalise(text)]
    if not matches:
        raise UsageError(f"answer '{str(answer)[:80]}' is none of the options {options}")
    return LETTERS[matches[0]]


def strip_letter(option: str) -> str:
    """'B. a red car' -> 'a red car': option texts shipped with their letters."""
    return re.sub(r"^\s*\(?[A-J][.):]\s*", "", str(option))


def make_item(
    video, question, answer, options=None, at=None, kind=None, fmt="text", split=None
) -> Item:
    options = [str(o) for o in (options or [])]
    if len(options) > len(LETTERS):
        raise UsageError(f"'{str(question)[:60]}' has more than {len(LETTERS)} options")
    if at is not None and not _seconds(at):
        shown = repr(at)[:40]
        raise UsageError(
            f"the moment of '{str(question)[:60]}' is not a number of seconds: {shown}"
        )
    if fmt not in FORMATS:
        raise UsageError(f"unknown answer format {fmt!r} (known: {', '.join(FORMATS)})")
    if options:
        gold = option_letter(answer, options)
    elif fmt == "none":
        gold = NOT_ANSWERABLE
    elif fmt in ("int", "float"):
        number = _first_number(str(answer))
        if number is None:
            raise UsageError(f"the answer to '{str(question)[:60]}' is not a number: {answer!r}")
        gold = _plain_number(number)
    elif fmt == "list":
        gold = json.dumps(_list_items(answer))
    else:
        gold = normalise(answer)
    return Item(
        str(video),
        str(question),
        gold,
        tuple(options),
        None if at is None else float(at),
        str(kind or "all"),
        "letter" if options else fmt,
        None if split is None else str(split),
    )


def _seconds(value) -> bool:
    """A moment in a stream: a finite, non-negative number (an int of 400 digits is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value)) and value >= 0
    except OverflowError:
        return False


def _first_number(text: str) -> float | None:
    found = re.search(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", text)
    if not found:
        return None
    try:
        return float(found.group(0).replace(",", ""))
    except ValueError:
        return None


def _plain_number(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _list_items(answer) -> list[str]:
    """A list answer as its sorted normalised items: a JSON or Python list, or comma-separated."""
    if isinstance(answer, str):
        text = answer.strip()
        try:
            parsed = json.loads(text.replace("'", '"')) if text.startswith("[") else None
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        answer = parsed if isinstance(parsed, list) else re.split(r"[,;\n]", text.strip("[]"))
    return sorted(n for n in (normalise(x) for x in answer) if n)


def predicted(item: Item, text: str) -> str:
    """The model's answer in the gold answer's terms."""
    if item.options:  # multiple choice, whatever the format says
        head = re.match(r"\s*\(?([A-Ja-j])\b", text)
        if head and head.group(1).upper() in LETTERS[: len(item.options)]:
            return head.group(1).upper()
        for i, option in enumerate(item.options):
            if normalise(option) and normalise(option) == normalise(text):
                return LETTERS[i]
        return normalise(text)
    if item.format in ("int", "float"):
        number = _first_number(text)
        return normalise(text) if number is None else _plain_number(number)
    if item.format == "list":
        return json.dumps(_list_items(text))
    said = normalise(text)
    if item.format == "none" and NOT_ANSWERABLE in said:
        return NOT_ANSWERABLE  # "it is not answerable from the document" counts
    return said


def correct(item: Item, prediction: str) -> bool:
    """Whether a prediction (from `predicted`) scores. Floats match within 1% relative, also as a
    percentage (0.25 against 25); everything else matches exactly."""
    if item.format == "float" and prediction != item.answer:
        try:
            got, gold = float(prediction), float(item.answer)
        except ValueError:
            return False
        return any(math.isclose(got * s, gold, rel_tol=FLOAT_TOLERANCE) for s in (1, 100, 0.01))
    return prediction == item.answer
