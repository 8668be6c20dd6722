"""What the CLI's commands share: option declarations, completion, and the one-line error shell."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from mmkv_cli.core.errors import MmkvError
from mmkv_cli.core.options import Dtype, EncodeOptions, LoadOptions
from mmkv_cli.reduce import REDUCERS


def method_names(incomplete: str) -> list[str]:
    from mmkv_cli.methods.choice import method_names

    return [n for n in method_names() if n.startswith(incomplete)]


def model_names(incomplete: str) -> list[str]:
    from mmkv_cli.backbones.spec import model_names

    return [n for n in model_names() if n.startswith(incomplete)]


def devices(incomplete: str) -> list[str]:
    return [d for d in ("auto", "cpu", "cuda") if d.startswith(incomplete)]


JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
JsonLinesOpt = typer.Option(
    False, "--json", help="Print one JSON object per question on stdout (JSONL), nothing else."
)
ModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    help="Preset name, HF id or local path (default: $MMKV_MODEL, the config file's model, or "
    "llava-ov-0.5b).",
    autocompletion=model_names,
)
PackModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    help="Override the model the pack names.",
    autocompletion=model_names,
)
DeviceOpt = typer.Option(
    "auto", "--device", help="auto, cpu, cuda or cuda:N.", autocompletion=devices
)
DtypeOpt = typer.Option(
    Dtype.auto,
    "--dtype",
    metavar="DTYPE",
    help="Weights' dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16.",
)
# the media and the budget, the same for every command that encodes (encode, batch, profile, eval)
FpsOpt = typer.Option(None, "--fps", help="Frames sampled per second (default: model preset).")
MaxFramesOpt = typer.Option(None, "--max-frames", help="At most this many frames (thinned evenly).")
BudgetTokensOpt = typer.Option(
    None, "--budget-tokens", help="Visual tokens kept per layer instead of a share."
)
MaxNewTokensOpt = typer.Option(16, "--max-new-tokens", help="Longest answer, in tokens.")


def ray_option(what: str):
    """--ray for a command that spreads `what` over Ray workers."""
    return typer.Option(
        None,
        "--ray",
        help=f"Spread {what} over Ray workers: local (start one here), auto (this node's cluster) "
        "or an address (ray://head:10001). Without it, all runs here.",
    )


# the shape of the Ray workers, the same for every command that runs on Ray (batch, eval, ask)
WorkersOpt = typer.Option(1, "--workers", help="Ray workers, each holding a backbone.", min=1)
CpusPerWorkerOpt = typer.Option(
    1.0, "--cpus-per-worker", help="CPU cores each Ray worker reserves."
)
GpusPerWorkerOpt = typer.Option(
    0.0, "--gpus-per-worker", help="GPUs each Ray worker reserves (fractions share one)."
)
# sampling, the same for every command that answers (ask, chat)
TemperatureOpt = typer.Option(0.0, "--temperature", help="0: greedy; above: sampled.")
TopPOpt = typer.Option(1.0, "--top-p", help="Nucleus mass when sampling.")
SeedOpt = typer.Option(None, "--seed", help="Sampling seed.")
StopOpt = typer.Option(None, "--stop", help="End the answer before this text (repeatable).")
KvBitsOpt = typer.Option(
    None,
    "--kv-bits",
    help="Bits per stored visual K/V value: 16 (as computed), 8, 4, 2 (KIVI layout) or 1.5 "
    "(VidKV: keys 2-bit on half the channels and 1-bit FFT signs on the rest, ternary values). "
    "Default: the method's own (16, but 4 for a method that quantizes as part of it).",
)
ReduceOpt = typer.Option(
    None,
    "--reduce",
    help="A token reducer between the vision tower and the prefill: "
    f"{', '.join(REDUCERS)}, or none (default: the method's own, if it has one).",
    autocompletion=lambda: [*REDUCERS, "none"],
)
KvGroupOpt = typer.Option(
    EncodeOptions().kv_group,
    "--kv-group",
    help="Quantization group: tokens per key group (across blocks), channels per value group.",
)


def quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")


def run(body: Callable[[], None]) -> None:
    """Every failure becomes one line on stderr and a non-zero exit; MMKV_DEBUG=1 re-raises."""
    from mmkv_cli.cli.display import error_console as err_console
    from mmkv_cli.cli.literal import literal

    try:
        quiet()
        body()
    except MmkvError as err:
        if os.environ.get("MMKV_DEBUG"):
            raise
        # the line may name a file, a pack's field or a user's text: printed as it is
        err_console.print(f"[red]error:[/red] {literal(err)}", highlight=False, soft_wrap=True)
        raise typer.Exit(err.exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except Exception as err:  # a bug: still one line, with a way to see more
        if os.environ.get("MMKV_DEBUG"):
            raise
        first = str(err).splitlines()[0] if str(err) else ""
        err_console.print(
            f"[red]error:[/red] internal error: {type(err).__name__}: {literal(first)} "
            "(run with MMKV_DEBUG=1 for a traceback)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(70) from None


def emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def load_options(model: str | None, device: str, dtype: Dtype, here: bool = True) -> LoadOptions:
    """The load options of a command, a --model given checked before anything heavy (a name that
    is not one, a checkpoint not here while the hub cannot be reached: one line in well under a
    second; the default model is checked where it is loaded). here: False where the model loads
    elsewhere (Ray workers)."""
    from mmkv_cli.backbones.spec import check_available

    if here and model is not None:
        check_available(model)
    return LoadOptions(model=model, device=device, dtype=dtype.value)


class Command(TyperCommand):
    """Help as people read it: arguments in the usage line in capitals (`PACK [QUESTIONS...]`, not
    Typer's `{pack}`), and flags without a type column (`<bool>` says nothing a flag does not)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name != "argument":
                pieces += param.get_usage_pieces(ctx)
                continue
            name = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
            pieces.append(name if param.required else f"[{name}]")
        return pieces

    def get_params(self, ctx) -> list:
        return _untyped_flags(super().get_params(ctx))

    def format_help(self, ctx, formatter) -> None:
        """Rich's panels where the terminal is wide; below 100 columns they leave the help a third
        of the line, so click's plain layout gives each option's help the width left of it."""
        if _terminal_width(ctx) >= WIDE_HELP:
            return super().format_help(ctx, formatter)
        _whole_words(formatter)
        return TyperCommand.__mro__[1].format_help(self, ctx, formatter)

    def get_short_help_str(self, limit: int = 45) -> str:
        """The summary whole (the listing wraps it), never cut at `limit` into '...'."""
        return " ".join((self.short_help or (self.help or "").split("\n\n")[0]).split())


WIDE_HELP = 100  # columns from which help is drawn in rich's panels


def _terminal_width(ctx) -> int:
    import shutil

    return ctx.terminal_width or shutil.get_terminal_size((80, 24)).columns


def _whole_words(formatter) -> None:
    """Click wraps help at hyphens (`llava-` / `ov-0.5b`, `mmlongbench-` / `doc`): have its wrapper
    split lines at spaces only, so a name one types is never broken across lines."""
    import importlib
    import textwrap

    package = type(formatter).__module__.rsplit(".", 1)[0]  # click, or Typer's copy of it
    wrapper = importlib.import_module(f"{package}._textwrap").TextWrapper
    wrapper.wordsep_re = textwrap.TextWrapper.wordsep_simple_re


class Group(TyperGroup):
    """The app itself: its flags (--version, --help) without a type column, as its commands'."""

    def get_params(self, ctx) -> list:
        return _untyped_flags(super().get_params(ctx))

    def format_help(self, ctx, formatter) -> None:
        """As a command's: rich's panels only where the terminal is wide."""
        if _terminal_width(ctx) >= WIDE_HELP:
            return super().format_help(ctx, formatter)
        _whole_words(formatter)
        return TyperGroup.__mro__[1].format_help(self, ctx, formatter)


def _untyped_flags(params: list) -> list:
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params
