"""Typer app: encode, ask, inspect, profile, methods, models. A thin shell over api.py."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable

import typer

from mmkv_cli.errors import MmkvError, UsageError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Encode video, image sets and documents into compressed KV caches; answer from them later.",
)

JsonOpt = typer.Option(False, "--json", help="Print one JSON object on stdout, nothing else.")
ModelOpt = typer.Option(
    None,
    "--model",
    "-m",
    help="Preset name, HF id or local path (default: $MMKV_MODEL or llava-ov-0.5b).",
)
DeviceOpt = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
DtypeOpt = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16.")


def _quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


def _run(body: Callable[[], None]) -> None:
    """Every failure becomes one line on stderr and a non-zero exit; MMKV_DEBUG=1 re-raises."""
    from mmkv_cli.display import err_console

    try:
        _quiet()
        body()
    except MmkvError as err:
        if os.environ.get("MMKV_DEBUG"):
            raise
        err_console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(err.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted", highlight=False)
        raise typer.Exit(130)
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
        raise typer.Exit(70)


def _emit_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


@app.command()
def encode(
    media: str = typer.Argument(..., help="Video file, PDF, image, image folder or glob."),
    output: str = typer.Option(..., "--output", "-o", help="The .kvpack to write."),
    method: str = typer.Option("full", "--method", help="Memory policy (see `mmkv methods`)."),
    budget: float | None = typer.Option(
        None, "--budget", help="Fraction of visual tokens kept, in (0, 1]."
    ),
    budget_tokens: int | None = typer.Option(
        None,
        "--budget-tokens",
        help="Visual tokens kept per layer, for methods with a fixed token budget (hermes).",
    ),
    fps: float | None = typer.Option(
        None, "--fps", help="Frames sampled per second (default: model preset)."
    ),
    max_frames: int | None = typer.Option(None, "--max-frames", help="At most this many frames."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output."),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Turn media into the model's KV cache, compress it with METHOD and save it as a .kvpack."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.display import budget_label, encode_progress, human_bytes, out_console

        if as_json:
            info = api.encode(
                media,
                output,
                model,
                method,
                budget,
                device,
                dtype,
                fps,
                max_frames,
                force,
                budget_tokens=budget_tokens,
            )
            _emit_json(info)
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
                media,
                output,
                model,
                method,
                budget,
                device,
                dtype,
                fps,
                max_frames,
                force,
                progress=on_progress,
                on_start=on_start,
                budget_tokens=budget_tokens,
            )
        finally:
            if started:
                bar.stop()
        out_console.print(
            f"wrote {info['path']}: {info['method']} ({budget_label(info)}), "
            f"{info['visual_tokens_kept']}/{info['visual_tokens_total']} visual tokens, "
            f"{info['blocks']} blocks, {human_bytes(info['bytes'])}, {info['encode_s']:.2f}s",
            highlight=False,
        )

    _run(body)


@app.command()
def ask(
    pack: str = typer.Argument(..., help="A .kvpack written by `mmkv encode`."),
    question: str = typer.Argument(..., help="The question; '-' reads it from stdin."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest answer, in tokens."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Override the model the pack names."
    ),
    explain: bool = typer.Option(
        False, "--explain", help="List the retrieved blocks and their scores."
    ),
    at: float | None = typer.Option(
        None, "--at", help="The question's moment (s): only earlier blocks count."
    ),
    positions: str | None = typer.Option(
        None, "--positions", help="keep | reindex (default: the method's)."
    ),
    prune: str | None = typer.Option(
        None,
        "--prune",
        help="Prune the context's visual KV by the question's "
        "attention before decoding: aircache, snapkv or pyramidkv.",
    ),
    budget: float | None = typer.Option(
        None, "--budget", help="With --prune: fraction of visual KV kept."
    ),
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Answer QUESTION from a saved pack, without the media."""

    def body() -> None:
        from mmkv_cli import api

        text = sys.stdin.read().strip() if question == "-" else question.strip()
        if not text:
            raise UsageError("the question is empty")
        if max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if positions not in (None, "keep", "reindex"):
            raise UsageError(f"unknown --positions '{positions}' (keep, reindex)")
        options = dict(at=at, positions=positions, prune=prune, budget=budget)
        if as_json:
            answer = api.ask(pack, text, model, device, dtype, max_new_tokens, **options)
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

        answer = api.ask(
            pack, text, model, device, dtype, max_new_tokens, on_token=stream, **options
        )
        sys.stdout.write("\n")
        if explain:
            from mmkv_cli.display import show_retrieved

            show_retrieved(answer.retrieved, answer.blocks_used)

    _run(body)


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
        None, "--budget", help="Budget for every method (default: presets)."
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
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure encode time, pack size, memory and ask latency, method against method."""

    def body() -> None:
        from mmkv_cli import profile as prof
        from mmkv_cli.display import show_profile

        names = [m.strip() for m in methods.split(",") if m.strip()]
        result = prof.profile(
            media, names, model, budget, question, max_new_tokens, device, dtype, fps, max_frames
        )
        if plot:
            prof.plot(result, plot)
            result["plot"] = plot
        _emit_json(result) if as_json else show_profile(result)

    _run(body)


@app.command()
def methods(as_json: bool = JsonOpt) -> None:
    """List the compression methods and their preset defaults."""

    def body() -> None:
        from mmkv_cli.display import show_listing
        from mmkv_cli.presets import load_method_preset, method_names

        rows = []
        for name in method_names():
            preset = load_method_preset(name)
            rows.append(
                {
                    "name": name,
                    "budget": preset.budget,
                    "description": preset.description,
                    "paper": preset.paper,
                    "params": preset.params,
                }
            )
        _emit_json({"methods": rows}) if as_json else show_listing(
            "methods", rows, ["name", "budget", "description"]
        )

    _run(body)


@app.command()
def models(as_json: bool = JsonOpt) -> None:
    """List the model presets (any HF id or local path of a supported family works too)."""

    def body() -> None:
        from mmkv_cli.backbones import default_model
        from mmkv_cli.display import show_listing
        from mmkv_cli.presets import load_model_preset, model_names

        rows = []
        for name in model_names():
            p = load_model_preset(name)
            rows.append(
                {
                    "name": name,
                    "family": p.family,
                    "source": p.source,
                    "description": p.description,
                    "default": name == default_model(),
                }
            )
        _emit_json({"models": rows, "default": default_model()}) if as_json else show_listing(
            f"models (default: {default_model()})",
            rows,
            ["name", "family", "source", "description"],
        )

    _run(body)


@app.command("eval")
def eval_(
    qa_file: str = typer.Argument(
        ...,
        help="Questions: JSONL {video, question, options?, answer, timestamp?} or ReKV/MLVU JSON.",
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
    positions: str | None = typer.Option(
        None, "--positions", help="keep | reindex (default: each method's)."
    ),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens"),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N questions."),
    fps: float | None = typer.Option(None, "--fps"),
    max_frames: int | None = typer.Option(None, "--max-frames"),
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: str = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Score methods and budgets on a question set: each clip encoded once per run, answers from the pack."""

    def body() -> None:
        from pathlib import Path

        from mmkv_cli import evaluate as ev
        from mmkv_cli.backbones import default_model, load_backbone
        from mmkv_cli.display import eval_progress, show_eval
        from mmkv_cli.methods import build_method
        from mmkv_cli.presets import check_budget

        if positions not in (None, "keep", "reindex"):
            raise UsageError(f"unknown --positions '{positions}' (keep, reindex)")
        names = [m.strip() for m in methods.split(",") if m.strip()]
        try:
            levels = [check_budget(float(b)) for b in budgets.split(",") if b.strip()]
        except ValueError:
            raise UsageError(f"--budgets must be numbers in (0, 1], not '{budgets}'") from None
        plan = []
        for name in names:
            _, policy = build_method(
                name, levels[0] if levels else None
            )  # unknown names fail here, early
            plan += [(name, 1.0)] if policy.keeps_all else [(name, b) for b in levels]
        items = ev.load_items(qa_file)[:limit]
        if not items:
            raise UsageError(f"{qa_file} holds no questions")
        chosen = model or default_model()
        backbone = load_backbone(chosen, device, dtype)
        root = Path(out)
        runs = []
        clips = len({i.video for i in items})
        with eval_progress() as bar:
            for name, budget in plan:
                task = bar.add_task(f"{name} b{budget:g}", total=clips)
                runs.append(
                    ev.evaluate_run(
                        items,
                        ev.run_folder(root, chosen, name, budget),
                        backbone,
                        chosen,
                        name,
                        budget,
                        fps=fps,
                        max_frames=max_frames,
                        positions=positions,
                        max_new_tokens=max_new_tokens,
                        on_clip=lambda n, task=task: bar.update(task, completed=n),
                    )
                )
        figure = ev.run_folder(root, chosen, "x", 1).parent / "accuracy_vs_budget.png"
        ev.plot(runs, figure)
        if as_json:
            fields = ("method", "budget", "kept", "accuracy", "by_type", "n")
            _emit_json({"runs": [{k: r.get(k) for k in fields} for r in runs], "plot": str(figure)})
        else:
            show_eval(runs, str(figure))

    _run(body)


@app.command()
def synth(
    out_dir: str = typer.Argument(..., help="Folder for clips/ and qa.jsonl (created)."),
    clips: int = typer.Option(8, "--clips", help="How many clips."),
    frames: int = typer.Option(64, "--frames", help="Frames per clip."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same clips and questions."),
    fps: float = typer.Option(2.0, "--fps", help="Frame rate of the written videos."),
    kind: str = typer.Option(
        "mixed", "--kind", help="mixed | normal | needle (mixed: every other clip a needle)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a set already in OUT_DIR."),
    as_json: bool = JsonOpt,
) -> None:
    """Write synthetic shape clips and their questions (qa.jsonl, the `mmkv eval` format)."""

    def body() -> None:
        from mmkv_cli.display import out_console
        from mmkv_cli.synth import write_dataset

        info = write_dataset(out_dir, clips, frames, seed, fps, kind=kind, force=force)
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
    app()
