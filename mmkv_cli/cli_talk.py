"""The CLI's conversational commands: chat and serve (registered on the app in cli.py)."""

from __future__ import annotations

import contextlib
import sys

import typer

from mmkv_cli.cli_common import DeviceOpt, DtypeOpt, load_options, model_names, run
from mmkv_cli.options import AskOptions, Dtype, GenerationOptions


def chat(
    pack: str = typer.Argument(..., help="A .kvpack written by `mmkv encode`."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above: sampled."),
    turns: int = typer.Option(
        8, "--turns", help="Earlier turns a follow-up sees (0: none).", min=0
    ),
    turn_tokens: int = typer.Option(
        2048, "--turn-tokens", help="At most this many tokens of earlier turns.", min=0
    ),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Override the model the pack names.", autocompletion=model_names
    ),
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
) -> None:
    """Ask a pack question after question; answers stream, follow-ups see earlier turns (/help)."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.chat import Chat, chat_loop
        from mmkv_cli.display import err_console, show_retrieved

        if temperature < 0:
            raise typer.BadParameter("--temperature must be >= 0")
        session = api.PackSession(pack, load=load_options(model, device, dtype))
        options = AskOptions(generation=GenerationOptions(max_new_tokens, temperature))
        interactive = sys.stdin.isatty()
        if interactive:
            err_console.print(
                f"[dim]{pack}: ask away; /help lists the commands, /quit or Ctrl-D leaves[/dim]"
            )

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        def note(line: str) -> None:
            err_console.print(line, highlight=False, markup=False)

        chat_loop(
            session,
            _typed_lines() if interactive else sys.stdin,
            Chat(options, turns, turn_tokens),
            write,
            note,
            lambda answer: show_retrieved(answer.retrieved, answer.blocks_used),
        )

    run(body)


def _typed_lines():
    """Lines typed at a terminal, with line editing (readline) when the platform has it."""
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (enables editing and history for input())
    while True:
        try:
            yield input("> ")
        except EOFError:
            sys.stdout.write("\n")
            return
