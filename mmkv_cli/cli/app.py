"""Typer app: encode, ask, inspect, profile, eval, synth, methods, models. A thin shell over api.py.

Start-up stays light: torch and transformers are imported inside the commands that run a model, so
`mmkv --help`, `methods`, `models` and `inspect` answer in well under a second.
"""

from __future__ import annotations

import sys
import time

import typer

from mmkv_cli import __version__
from mmkv_cli.cli import asking as cli_asking
from mmkv_cli.cli import batch as cli_batch
from mmkv_cli.cli import live as cli_live
from mmkv_cli.cli import packs as cli_pack
from mmkv_cli.cli import registry as cli_registry
from mmkv_cli.cli import server as cli_server
from mmkv_cli.cli import settings as cli_settings
from mmkv_cli.cli import study as cli_study
from mmkv_cli.cli import talk as cli_talk
from mmkv_cli.cli.common import (
    BudgetTokensOpt,
    Command,
    DeviceOpt,
    DtypeOpt,
    FpsOpt,
    Group,
    JsonOpt,
    KvBitsOpt,
    KvGroupOpt,
    MaxFramesOpt,
    ModelOpt,
    ReduceOpt,
    emit_json,
    load_options,
    method_names,
    run,
)
from mmkv_cli.core.errors import MmkvError, SetupError
from mmkv_cli.core.options import (
    Dtype,
    EncodeOptions,
)
from mmkv_cli.core.runtime import python_problem

app = typer.Typer(
    cls=Group,
    add_completion=True,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Encode video, image sets and documents into compressed KV caches; answer from them "
    "later.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mmkv {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        help="Print the version and exit.",
        callback=_version,
        is_eager=True,
    ),
    presets: str | None = typer.Option(
        None,
        "--presets",
        help="A folder of user presets (methods/, models/) over the built-in ones.",
    ),
    verbose: int = typer.Option(
        0, "--verbose", "-v", count=True, help="Log what happens: -v steps, -vv details."
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="Only answers, results and errors: no notes or progress."
    ),
    log_level: str | None = typer.Option(
        None,
        "--log-level",
        help="Log records from this level: debug, info, warning, error (default: $MMKV_LOG, "
        "else warning).",
    ),
) -> None:
    """Encode video, image sets and documents into compressed KV caches; answer from them later."""
    import logging
    import os

    from mmkv_cli.cli.log_lines import show_logs
    from mmkv_cli.core.config import Config, config
    from mmkv_cli.core.logs import level_named
    from mmkv_cli.presets import use_presets

    def body() -> None:
        # `mmkv config` reads the file itself (its faults in its own line), and `--init` makes it
        chosen = Config() if ctx.invoked_subcommand == "config" else config()
        if log_level is not None:
            level = level_named(log_level, "--log-level")
        elif os.environ.get("MMKV_LOG"):
            level = level_named(os.environ["MMKV_LOG"], "MMKV_LOG")
        elif verbose or quiet or not chosen.log_level:
            level = logging.ERROR if quiet else logging.WARNING - 10 * min(verbose, 2)
        else:
            level = level_named(chosen.log_level, "log_level")
        show_logs(level, quiet)
        if quiet:
            os.environ["MMKV_QUIET"] = "1"  # no status line from a client either
        use_presets(presets or chosen.presets)  # and $MMKV_PRESETS, then the built-in ones

    run(body)


@app.command(cls=Command)
def encode(
    media: str = typer.Argument(..., help="Video file, PDF, image, image folder or glob."),
    output: str = typer.Option(..., "--out", "-o", "--output", help="The .kvpack to write."),
    method: str = typer.Option(
        "full",
        "--method",
        help="Memory policy or preset (see `mmkv methods`).",
        autocompletion=method_names,
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="Share of visual tokens kept, in (0, 1] (compressing methods)."
    ),
    budget_tokens: int | None = BudgetTokensOpt,
    guidance_prompt: str | None = typer.Option(
        None,
        "--guidance-prompt",
        help="The prompt whose attention scores tokens at encode, for the methods that use one "
        "(default: one fitting the media kind).",
    ),
    fps: float | None = FpsOpt,
    max_frames: int | None = MaxFramesOpt,
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    kv_bits: float | None = KvBitsOpt,
    kv_group: int = KvGroupOpt,
    reduce: str | None = ReduceOpt,
    checkpoint_every: int = typer.Option(
        0,
        "--checkpoint-every",
        help="Save the streaming state every N chunks beside the output (a killed encode resumes).",
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the checkpoint an interrupted encode left."
    ),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    no_server: bool = cli_server.NoServerOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Turn media into the model's KV cache, compress it with METHOD and save it as a .kvpack."""

    def body() -> None:
        from rich.text import Text

        from mmkv_cli.cli.display import encoded_line, err_console, out_console, thinning_note
        from mmkv_cli.cli.progress import encode_progress

        options = EncodeOptions(
            method,
            budget,
            budget_tokens,
            fps,
            max_frames,
            guidance_prompt,
            force,
            kv_bits=kv_bits,
            kv_group=kv_group,
            checkpoint_every=checkpoint_every,
            resume=resume,
            reduce=reduce,
        )
        load = load_options(model, device, dtype)
        encoding = cli_server.encoder(media, output, options, load, no_server)

        def note_thinning(frames: int, offered: int) -> None:  # before the encode, not after
            if offered > frames:
                err_console.print(Text(thinning_note(frames, offered, max_frames, "taking")))

        if as_json:
            emit_json(encoding(on_start=note_thinning))
            return
        bar = encode_progress()
        task = bar.add_task("encode", total=None, rate="")
        started = {}

        def on_start(frames: int, offered: int) -> None:  # once media and model are loaded
            note_thinning(frames, offered)
            started["t"] = time.perf_counter()
            bar.update(task, total=frames)
            bar.start()

        def on_progress(frames: int, tokens: int) -> None:
            rate = tokens / max(1e-6, time.perf_counter() - started["t"])
            bar.update(task, completed=frames, rate=f"{rate:,.0f} tok/s")

        try:
            info = encoding(progress=on_progress, on_start=on_start)
        finally:
            if started:
                bar.stop()
        out_console.print(Text(encoded_line(info)))  # two lines, each part made visible

    run(body)


app.command(cls=Command)(cli_asking.ask)


@app.command(cls=Command)
def inspect(
    pack: str = typer.Argument(..., help="A .kvpack (a folder: its packs, as ls lists them)."),
    as_json: bool = JsonOpt,
) -> None:
    """Show what a pack holds: model, method, blocks, tokens and bytes per layer."""

    def body() -> None:
        from pathlib import Path

        from mmkv_cli import api
        from mmkv_cli.cli.display import show_inspect, show_listing_of_packs

        if Path(pack).is_dir():  # a folder of packs: one line each
            rows = api.listing(pack)
            emit_json(rows) if as_json else show_listing_of_packs(pack, rows)
            return
        info = api.inspect(pack)
        hot = cli_server.hot_state(pack)  # held by a running warm server: what `ps` says of it
        if hot is not None:
            info["hot"] = hot
        emit_json(info) if as_json else show_inspect(info)

    run(body)


app.command(cls=Command)(cli_registry.methods)
app.command(cls=Command)(cli_registry.models)
app.command(cls=Command)(cli_live.live)
app.command(cls=Command)(cli_study.profile)
app.command("eval", cls=Command)(cli_study.eval_)
app.command(cls=Command)(cli_study.synth)
app.command(cls=Command)(cli_talk.chat)
app.command(cls=Command)(cli_talk.serve)
app.command(cls=Command)(cli_pack.convert)
app.command(cls=Command)(cli_pack.verify)
app.command(cls=Command)(cli_pack.ls)
app.command(cls=Command)(cli_batch.batch)
app.command("config", cls=Command)(cli_settings.config_command)
app.command(cls=Command)(cli_server.ps)
app.command(cls=Command)(cli_server.stop)


_LOG_FLAGS = {"-v", "-vv", "-vvv", "--verbose", "-q", "--quiet"}


def _log_flags_first(command, args: list[str]) -> list[str]:
    """-v and -q given after the command's name (`mmkv ask -v PACK Q`) moved before it, where the
    app takes them; never a value of another option (`--stop -q`), nor after `--`."""
    named = _subcommand(command, args)
    sub = command.commands.get(args[named]) if named is not None else None
    if sub is None:
        return args
    valued = _valued(sub)
    moved, rest = [], args[: named + 1]
    for i, arg in enumerate(args[named + 1 :], named + 1):
        if arg == "--":
            rest += args[i:]
            break
        if arg in _LOG_FLAGS and args[i - 1] not in valued:
            moved.append(arg)
        else:
            rest.append(arg)
    return moved + rest


def _valued(command) -> set[str]:
    """The names of `command`'s options that take a value (a flag or a count takes none)."""
    return {
        name
        for param in command.params
        if param.param_type_name == "option" and not (param.is_flag or param.count)
        for name in param.opts
    }


def _subcommand(command, args: list[str]) -> int | None:
    """Where in `args` the command's name is: the first word that is neither an option of mmkv's
    own nor its value."""
    valued = _valued(command)
    at = 0
    while at < len(args):
        if args[at] in valued:
            at += 2
        elif args[at].startswith("-"):
            at += 1
        else:
            return at
    return None


def main() -> None:
    """The console entry point: a usage error is one line on stderr and exit 2, as any other
    error."""
    too_old = python_problem()
    if too_old:
        sys.stderr.write(f"error: {too_old}\n")
        sys.exit(SetupError.exit_code)
    if not sys.argv[1:]:
        sys.argv.append("--help")
    command = typer.main.get_command(app)
    sys.argv[1:] = _log_flags_first(command, sys.argv[1:])
    try:
        # the config file's, under the command line's; `mmkv config` reads (or makes) it itself
        at = _subcommand(command, sys.argv[1:])
        wanted = sys.argv[1 + at] if at is not None else None
        defaults = {} if wanted == "config" else cli_settings.command_defaults()
    except MmkvError as err:
        sys.stderr.write(f"error: {err}\n")
        sys.exit(err.exit_code)
    try:
        code = command.main(prog_name="mmkv", standalone_mode=False, default_map=defaults)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except typer.TyperException as err:  # click's usage errors: a bad option, value or argument
        message = " ".join(err.format_message().split())
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
