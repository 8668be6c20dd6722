"""`mmkv chat PACK`: questions typed one after another, answers streamed as they come.

A follow-up sees the earlier turns, as chat models do: the last `turns` questions and answers (at
most `tokens` tokens of them, oldest dropped first) go after the pack's context and before the new
question. Retrieval still reads the new question alone. Commands start with '/'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.options import AskOptions
from mmkv_cli.methods import pruning_methods

HISTORY_TURNS = 8  # turns a follow-up sees
HISTORY_TOKENS = 2048  # and at most this many tokens of them

HELP = f"""commands:
  /at SECONDS   ask as if the video ended there (/at off: the whole pack)
  /explain      the blocks the last answer was given (retrieval scores)
  /prune METHOD BUDGET   prune each context by its question ({", ".join(pruning_methods())})
  /prune off    stop pruning
  /reset        forget the earlier turns
  /quit         leave (or Ctrl-D)"""

Say = Callable[[str], None]


@dataclass
class Chat:
    """What a chat remembers between lines."""

    options: AskOptions
    turns: int = HISTORY_TURNS
    tokens: int = HISTORY_TOKENS
    history: list[tuple[str, str]] = field(default_factory=list)
    last: object = None  # the last Answer
    failed: int = 0  # questions that got an error, not an answer (the exit code says so)


def chat_loop(session, lines: Iterable[str], chat: Chat, write: Say, note: Say, explain) -> None:
    """Answer each line (or run its command) until /quit or the lines end. write: the answer as it
    streams (stdout); note: one-line messages (stderr); explain(answer): show its retrieval."""
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            try:
                if command(chat, text, note, explain) == "quit":
                    return
            except UsageError as err:
                note(f"error: {err}")
            continue
        options = replace(chat.options, history=tuple(recent_turns(session, chat)))
        try:
            answer = session.ask(text, options, on_token=write)
        except MmkvError as err:
            note(f"error: {err}")
            chat.failed += 1
            continue
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the chat (as ollama's does)
            write("\n")
            note("(answer stopped; the turn is not kept)")
            continue
        write("\n")
        chat.history.append((text, answer.answer))
        chat.last = answer


def recent_turns(session, chat: Chat) -> list[tuple[str, str]]:
    """The turns a follow-up sees: the last `turns`, fewer while they pass `tokens` tokens."""
    turns = chat.history[-chat.turns :] if chat.turns > 0 else []
    while turns and session.turn_tokens(tuple(turns)) > chat.tokens:
        turns = turns[1:]
    return turns


def command(chat: Chat, text: str, note: Say, explain) -> str | None:
    """Run one /command; returns "quit" to leave."""
    name, *args = text.split()
    if name in ("/quit", "/exit", "/q"):
        return "quit"
    if name == "/help":
        note(HELP)
    elif name == "/reset":
        chat.history.clear()
        note("earlier turns forgotten")
    elif name == "/explain":
        if chat.last is None:
            note("nothing asked yet")
        else:
            explain(chat.last)
    elif name == "/at":
        chat.options = replace(chat.options, at=_moment(args))
        note(f"asking at {chat.options.at:g} s" if chat.options.at is not None else "whole pack")
    elif name == "/prune":
        if args == ["off"]:
            chat.options = replace(chat.options, prune=None, prune_budget=None)
            note("no pruning")
        elif len(args) == 2:
            from mmkv_cli.ask.prune import ask_pruner  # torch: only when a chat prunes

            budget = _number(args[1], "/prune BUDGET")
            ask_pruner(args[0], budget)  # refuses a method that cannot prune, or a bad budget
            chat.options = replace(chat.options, prune=args[0], prune_budget=budget)
            note(f"pruning each context with {args[0]} to {budget:g}")
        else:
            raise UsageError("/prune METHOD BUDGET, or /prune off")
    else:
        raise UsageError(f"unknown command {name} (/help lists them)")
    return None


def _moment(args: list[str]) -> float | None:
    if args == ["off"]:
        return None
    if len(args) != 1:
        raise UsageError("/at SECONDS, or /at off")
    value = _number(args[0], "/at SECONDS")
    if value < 0:
        raise UsageError("/at SECONDS must be >= 0")
    return value


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{what}: '{text}' is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise UsageError(f"{what}: '{text}' is not a finite number")
    return value
