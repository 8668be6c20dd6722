"""Typer app: encode, ask, inspect, profile, eval, synth, methods, models. A thin shell over api.py.

Start-up stays light: torch and transformers are imported inside the commands that run a model, so
`mmkv --help`, `methods`, `models` and `inspect` answer in well under a second.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from enum import Enum

import typer

from mmkv_cli import __version__
from mmkv_cli.errors import MmkvError, UsageError
from mmkv_cli.options import (
    AskOptions,
    Dtype,
    EncodeOptions,
    GenerationOptions,
    LoadOptions,
    Positions,
)

app = typer.Typer(
    add_completion=True,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Encode video, image sets and documents into compressed KV caches; answer from them "
    "later.",
)


class PruneMethod(str, Enum):
    """Methods that prune a context's visual KV by the question (`ask --prune`)."""

    aircache = "aircache"
    snapkv = "snapkv"
    pyramidkv = "pyramidkv"


class ClipKind(str, Enum):
    mixed = "mixed"
    normal = "normal"
    needle = "needle"


def _method_names(incomplete: str) -> list[str]:
    from mmkv_cli.presets import method_names

    return [n for n in method_names() if n.startswith(incomplete)]


def _model_names(incomplete: str) -> list[str]:
    from mmkv_cli.presets import model_names

    return [n for n in model_names() if n.startswith(incomplete)]


def _devices(incomplete: str) -> list[str]:
    return [d for d in ("auto", "cpu", "cuda") if d.startswith(incomplete)]


JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
ModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    help="Preset name, HF id or local path (default: $MMKV_MODEL or llava-ov-0.5b).",
    autocompletion=_model_names,
)
DeviceOpt = typer.Option(
    "auto", "--device", help="auto, cpu, cuda or cuda:N.", autocompletion=_devices
)
DtypeOpt = typer.Option(Dtype.auto, "--dtype", help="Weights' dtype (auto: bf16 on CUDA).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mmkv {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_version, is_eager=True
    ),
    presets: str | None = typer.Option(
        None,
        "--presets",
        help="A folder of user presets (methods/, models/) over the built-in ones.",
    ),
) -> None:
    """Encode video, image sets and documents into compressed KV caches; answer from them later."""
    from mmkv_cli.presets import use_presets

    _run(lambda: use_presets(presets))  # None: the built-in and $MMKV_PRESETS ones only


def _quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")


def _run(body: Callable[[], None]) -> None:
    """Every failure becomes one line on stderr and a non-zero exit; MMKV_DEBUG=1 re-raises."""
    from mmkv_cli.display import err_console

    try:
        _quiet()
        body()
    except MmkvError as err:
        if os.environ.get("MMKV_DEBUG"):
            raise
        err_console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True, markup=True)
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
            f"[red]error:[/red] internal error: {type(err).__name__}: {first} "
            "(run with MMKV_DEBUG=1 for a traceback)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(70) from None


def _emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _load(model: str | None, device: str, dtype: Dtype) -> LoadOptions:
    return LoadOptions(model=model, device=device, dtype=dtype.value)


@app.command()
def encode(
    media: str = typer.Argument(..., help="Video file, PDF, image, image folder or glob."),
    output: str = typer.Option(..., "--output", "-o", help="The .kvpack to write."),
    method: str = typer.Option(
        "full",
        "--method",
        help="Memory policy or preset (see `mmkv methods`).",
        autocompletion=_method_names,
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="Share of visual tokens kept, in (0, 1] (compressing methods)."
    ),
    budget_tokens: int | None = typer.Option(
        None, "--budget-tokens", help="Visual tokens kept per layer instead of a share."
    ),
    guidance_prompt: str | None = typer.Option(
        None,
        "--guidance-prompt",
        help="The prompt whose attention scores tokens at encode, for the methods that use one "
        "(default: one fitting the media kind).",
    ),
    fps: float | None = typer.Option(
        None, "--fps", help="Frames sampled per second (default: model preset)."
    ),
    max_frames: int | None = typer.Option(None, "--max-frames", help="At most this many frames."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Turn media into the model's KV cache, compress it with METHOD and save it as a .kvpack."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.display import encode_progress, encoded_line, out_console

        options = EncodeOptions(
            method, budget, budget_tokens, fps, max_frames, guidance_prompt, force
        )
        load = _load(model, device, dtype)
        if as_json:
            _emit_json(api.encode(media, output, options, load=load))
            return
        bar = encode_progress()
        task = bar.add_task("encode", total=None, rate="")
        started = {}

        def on_start(frames: int) -> None:  # the bar appears once media and model are loaded
            started["t"] = time.perf_counter()
            bar.update(task, total=frames)
            bar.start()

        def on_progress(frames: int, tokens: int) -> None:
            rate = tokens / max(1e-6, time.perf_counter() - started["t"])
            bar.update(task, completed=frames, rate=f"{rate:,.0f} tok/s")

        try:
            info = api.encode(
                media, output, options, load=load, progress=on_progress, on_start=on_start
            )
        finally:
            if started:
                bar.stop()
        out_console.print(encoded_line(info), highlight=False)

    _run(body)


@app.command()
def ask(
    pack: str = typer.Argument(..., help="A .kvpack written by `mmkv encode`."),
    question: str = typer.Argument(..., help="The question; '-' reads it from stdin."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest answer, in tokens."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above: sampled."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass when sampling."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed."),
    stop: list[str] | None = typer.Option(
        None, "--stop", help="End the answer before this text (repeatable)."
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Override the model the pack names.",
        autocompletion=_model_names,
    ),
    explain: bool = typer.Option(False, "--explain", help="List the retrieved blocks and scores."),
    at: float | None = typer.Option(
        None, "--at", help="The question's moment (s): only blocks shown by then count."
    ),
    positions: Positions | None = typer.Option(
        None, "--positions", help="Keep the stored positions or compact them (default: method's)."
    ),
    prune: PruneMethod | None = typer.Option(
        None, "--prune", help="Prune the context's visual KV by the question before decoding."
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="With --prune: share of the visual KV kept."
    ),
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Answer QUESTION from a saved pack, without the media."""

    def body() -> None:
        from mmkv_cli import api

        text = _read_question(question)
        if temperature < 0 or not 0 < top_p <= 1:
            raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
        options = AskOptions(
            at=at,
            positions=positions,
            prune=prune.value if prune else None,
            prune_budget=budget,
            generation=GenerationOptions(
                max_new_tokens, temperature, top_p, seed, tuple(stop or ())
            ),
        )
        load = _load(model, device, dtype)
        if as_json:
            answer = api.ask(pack, text, options, load=load)
            _emit_json(
                {
                    "question": text,
                    "answer": answer.answer,
                    "context_tokens": answer.context_tokens,
                    "ttft_s": answer.ttft_s,
                    "total_s": answer.total_s,
                    "decode_s_per_token": answer.decode_s_per_token,
                    "blocks": len(answer.blocks_used),
                    "bytes_read": answer.bytes_read,
                    "retrieved": answer.retrieved,
                    "kv_tokens_after_prune": answer.kv_tokens,
                }
            )
            return

        def stream(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        answer = api.ask(pack, text, options, load=load, on_token=stream)
        sys.stdout.write("\n")
        if explain:
            from mmkv_cli.display import show_retrieved

            show_retrieved(answer.retrieved, answer.blocks_used)

    _run(body)


def _read_question(question: str) -> str:
    if question == "-":
        try:
            text = sys.stdin.read()
        except UnicodeDecodeError:
            raise UsageError("the question on stdin is not UTF-8 text") from None
    else:
        text = question
    text = text.strip()
    if not text:
        raise UsageError("the question is empty")
    return text


@app.command()
def inspect(pack: str = typer.Argument(..., help="A .kvpack."), as_json: bool = JsonOpt) -> None:
    """Show what a pack holds: model, method, blocks, tokens and bytes per layer."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.display import show_inspect

        info = api.inspect(pack)
        _emit_json(info) if as_json else show_inspect(info)

    _run(body)


@app.command()
def profile(
    media: str = typer.Argument(..., help="Media to encode once per method."),
    methods: str = typer.Option("full,recency", "--methods", help="Comma-separated methods."),
    budget: float | None = typer.Option(
        None, "--budget", help="Budget for every compressing method (default: their own)."
    ),
    question: str = typer.Option(
        "what happened first?", "--question", help="Question asked from each pack."
    ),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens"),
    fps: float | None = typer.Option(None, "--fps"),
    max_frames: int | None = typer.Option(None, "--max-frames"),
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG of the ratios to full."),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure encode time, pack size, memory and ask latency, method against method."""

    def body() -> None:
        from mmkv_cli import profile as prof
        from mmkv_cli.display import show_profile

        names = [m.strip() for m in methods.split(",") if m.strip()]
        media_options = EncodeOptions(budget=budget, fps=fps, max_frames=max_frames)
        result = prof.profile(
            media, names, media_options, question, max_new_tokens, _load(model, device, dtype)
        )
        if plot:
            prof.plot(result, plot)
            result["plot"] = plot
        _emit_json(result) if as_json else show_profile(result)

    _run(body)


@app.command()
def methods(as_json: bool = JsonOpt) -> None:
    """List the compression methods: paper, default budget, parameters."""

    def body() -> None:
        from mmkv_cli.display import show_listing
        from mmkv_cli.presets import method_names, resolve_method
        from mmkv_cli.spec import as_plain, describe

        rows = []
        for name in method_names():
            choice = resolve_method(name)
            method = choice.method
            budget = choice.budget
            defaults = as_plain(choice.params)
            rows.append(
                {
                    "name": name,
                    "implements": method.name,
                    "description": choice.description,
                    "paper": {
                        "title": method.paper.title,
                        "year": method.paper.year,
                        "url": method.paper.url,
                    },
                    "budget": budget.label() if budget else "keeps all",
                    "budget_share": budget.share if budget else None,
                    "budget_tokens": budget.tokens if budget else None,
                    "abilities": method.abilities(),
                    "params": [
                        {**p, "value": defaults[p["name"]]} for p in describe(method.params)
                    ],
                }
            )
        if as_json:
            _emit_json({"methods": rows})
        else:
            show_listing("methods", rows, ["name", "budget", "description"])

    _run(body)


@app.command()
def models(as_json: bool = JsonOpt) -> None:
    """List the model presets (any HF id or local path of a supported family works too)."""

    def body() -> None:
        from mmkv_cli.display import show_listing
        from mmkv_cli.presets import default_model, load_model_spec, model_names

        rows = []
        for name in model_names():
            spec = load_model_spec(name)
            rows.append(
                {
                    "name": name,
                    "family": spec.family,
                    "source": spec.source,
                    "description": spec.description,
                    "default": name == default_model(),
                }
            )
        if as_json:
            _emit_json({"models": rows, "default": default_model()})
        else:
            title = f"models (default: {default_model()})"
            show_listing(title, rows, ["name", "family", "source", "description"])

    _run(body)


@app.command("eval")
def eval_(
    qa_file: str = typer.Argument(
        ..., help="Questions: JSONL {video, question, options?, answer, at?} or ReKV/MLVU JSON."
    ),
    methods: str = typer.Option("full,recency", "--methods", help="Comma-separated methods."),
    budgets: str = typer.Option(
        "0.5,0.1",
        "--budgets",
        help="Comma-separated budgets (methods that keep everything run once, at 1).",
    ),
    out: str = typer.Option(
        "eval", "--out", "-o", help="Results folder: OUT/<model>/<method>-b<budget>/."
    ),
    positions: Positions | None = typer.Option(
        None, "--positions", help="Keep or compact positions (default: each method's)."
    ),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens"),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N questions."),
    fps: float | None = typer.Option(None, "--fps"),
    max_frames: int | None = typer.Option(None, "--max-frames"),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Score methods and budgets on a question set: each clip encoded once per run."""

    def body() -> None:
        from mmkv_cli import evaluate as ev
        from mmkv_cli.display import show_eval

        names = [m.strip() for m in methods.split(",") if m.strip()]
        try:
            levels = [float(b) for b in budgets.split(",") if b.strip()]
        except ValueError:
            raise UsageError(f"--budgets must be numbers in (0, 1], not '{budgets}'") from None
        settings = ev.EvalSettings(
            fps=fps,
            max_frames=max_frames,
            positions=positions,
            max_new_tokens=max_new_tokens,
        )
        result = ev.evaluate(
            qa_file, names, levels, out, settings, _load(model, device, dtype), limit
        )
        if as_json:
            fields = ("method", "budget", "kept", "accuracy", "by_type", "n")
            _emit_json(
                {
                    "runs": [{k: r.get(k) for k in fields} for r in result["runs"]],
                    "plot": result["plot"],
                }
            )
        else:
            show_eval(result["runs"], result["plot"])

    _run(body)


@app.command()
def synth(
    out_dir: str = typer.Argument(..., help="Folder for clips/ and qa.jsonl (created)."),
    clips: int = typer.Option(8, "--clips", help="How many clips."),
    frames: int = typer.Option(64, "--frames", help="Frames per clip."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same clips and questions."),
    fps: float = typer.Option(2.0, "--fps", help="Frame rate of the written videos."),
    kind: ClipKind = typer.Option(
        ClipKind.mixed, "--kind", help="mixed: every other clip a needle."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a set already in OUT_DIR."),
    as_json: bool = JsonOpt,
) -> None:
    """Write synthetic shape clips and their questions (qa.jsonl, the `mmkv eval` format)."""

    def body() -> None:
        from mmkv_cli.display import out_console
        from mmkv_cli.synth import write_dataset

        info = write_dataset(out_dir, clips, frames, seed, fps, kind=kind.value, force=force)
        if as_json:
            _emit_json(info)
        else:
            out_console.print(
                f"wrote {info['clips']} clips of {frames} frames and {info['questions']} questions "
                f"to {info['folder']}",
                highlight=False,
            )

    _run(body)


def main() -> None:
    """The console entry point: a usage error is one line on stderr and exit 2, as any other
    error."""
    if not sys.argv[1:]:
        sys.argv.append("--help")
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="mmkv", standalone_mode=False)
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
