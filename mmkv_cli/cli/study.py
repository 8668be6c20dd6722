"""The CLI's study commands: profile, eval and synth (registered on the app in cli.py)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from mmkv_cli.cli.common import (
    CpusPerWorkerOpt,
    DeviceOpt,
    DtypeOpt,
    FpsOpt,
    GpusPerWorkerOpt,
    JsonOpt,
    KvBitsOpt,
    KvGroupOpt,
    MaxFramesOpt,
    MaxNewTokensOpt,
    ModelOpt,
    WorkersOpt,
    emit_json,
    load_options,
    ray_option,
    run,
)
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import Dtype, EncodeOptions, Positions, kv_bits_value


class ClipKind(str, Enum):
    mixed = "mixed"
    normal = "normal"
    needle = "needle"


def profile(
    media: str = typer.Argument(..., help="Media to encode once per method."),
    methods: str = typer.Option("full,recency", "--methods", help="Comma-separated methods."),
    budget: float | None = typer.Option(
        None, "--budget", help="Budget for every compressing method (default: their own)."
    ),
    question: str = typer.Option(
        "what happened first?", "--question", help="Question asked from each pack."
    ),
    max_new_tokens: int = MaxNewTokensOpt,
    fps: float | None = FpsOpt,
    max_frames: int | None = MaxFramesOpt,
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG of the ratios to full."),
    repeat: int = typer.Option(
        1, "--repeat", help="Runs per method after a warm-up; medians are reported.", min=1
    ),
    kv_bits: str = typer.Option(
        "16", "--kv-bits", help="Comma-separated stored bits to compare (16, 8, 4, 2, 1.5)."
    ),
    kv_group: int = KvGroupOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Measure encode time, pack size, memory and ask latency, method against method."""

    def body() -> None:
        from mmkv_cli.cli.study_display import show_profile
        from mmkv_cli.study import profile as prof

        names = [m.strip() for m in methods.split(",") if m.strip()]
        bits = [kv_bits_value(v.strip()) for v in kv_bits.split(",") if v.strip()]
        if plot and not Path(plot).resolve().parent.is_dir():  # before the work, not after
            raise UsageError(f"cannot write the plot {plot}: its folder does not exist")
        media_options = EncodeOptions(
            budget=budget, fps=fps, max_frames=max_frames, kv_group=kv_group
        )
        result = prof.profile(
            media,
            names,
            media_options,
            question,
            max_new_tokens,
            load_options(model, device, dtype),
            kv_bits=bits,
            repeat=repeat,
        )
        if plot:
            try:
                prof.plot(result, plot)
            except OSError as err:
                raise UsageError(f"cannot write the plot {plot}: {err.strerror or err}") from None
            result["plot"] = plot
        emit_json(result) if as_json else show_profile(result)

    run(body)


def eval_(
    qa_file: str = typer.Argument(
        ...,
        help="Questions: mmkv JSONL {video, question, options?, answer, at?}, MLVU/ReKV JSON, "
        "Video-MME (parquet/JSON), EgoSchema questions.json, OVO-Bench JSON or MMLongBench-Doc "
        "samples.json.",
    ),
    task: str | None = typer.Option(
        None,
        "--task",
        help="The file's format when it does not tell: mmkv, mlvu, videomme, egoschema, "
        "ovobench, streamingbench, rvs, mmlongbench-doc.",
    ),
    media: str | None = typer.Option(
        None, "--media", help="Folder holding the videos or PDFs (default: the file's folder)."
    ),
    methods: str = typer.Option("full,recency", "--methods", help="Comma-separated methods."),
    budgets: str | None = typer.Option(
        None,
        "--budgets",
        help="Comma-separated shares kept (default 0.5,0.1 unless --budget-tokens is given; "
        "methods that keep everything run once, at 1).",
    ),
    budget_tokens: str | None = typer.Option(
        None, "--budget-tokens", help="Comma-separated fixed memories, in tokens per layer."
    ),
    protocol: str = typer.Option(
        "auto",
        "--protocol",
        help="replay: encode each clip whole, ask at each moment; stream: answer each question "
        "when the stream reaches its moment, from the memory then; auto: stream where the "
        "questions carry moments and the budget can follow a stream.",
    ),
    out: str = typer.Option(
        "eval", "--out", "-o", "--output", help="Results folder: OUT/<model>/<method>-b<budget>/."
    ),
    positions: Positions | None = typer.Option(
        None, "--positions", help="Keep or compact positions (default: each method's)."
    ),
    max_new_tokens: int = typer.Option(8, "--max-new-tokens", help="Longest answer, in tokens."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N questions."),
    fps: float | None = FpsOpt,
    max_frames: int | None = MaxFramesOpt,
    fresh: bool = typer.Option(
        False, "--fresh", help="Start the runs over: drop answers earlier runs left in OUT."
    ),
    kv_bits: float | None = KvBitsOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    ray: str | None = ray_option("the videos"),
    workers: int = WorkersOpt,
    cpus_per_worker: float = CpusPerWorkerOpt,
    gpus_per_worker: float = GpusPerWorkerOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Score methods and budgets on a question set: each clip encoded once per run."""

    def body() -> None:
        from mmkv_cli.cli.progress import eval_progress
        from mmkv_cli.cli.study_display import show_eval, show_workers
        from mmkv_cli.study import evaluate as ev

        names = [m.strip() for m in methods.split(",") if m.strip()]
        shares = budgets if budgets is not None else ("" if budget_tokens else "0.5,0.1")
        try:
            levels = [float(b) for b in shares.split(",") if b.strip()]
        except ValueError:
            raise UsageError(f"--budgets must be numbers in (0, 1], not '{budgets}'") from None
        try:
            tokens = tuple(int(t) for t in (budget_tokens or "").split(",") if t.strip())
        except ValueError:
            raise UsageError(
                f"--budget-tokens must be whole numbers, not '{budget_tokens}'"
            ) from None
        settings = ev.EvalSettings(
            fps=fps,
            max_frames=max_frames,
            positions=positions,
            max_new_tokens=max_new_tokens,
            kv_bits=kv_bits_value(kv_bits) if kv_bits is not None else None,
            protocol=protocol,
            budget_tokens=tokens,
        )
        if ray is None and workers > 1:
            raise UsageError("--workers > 1 runs on Ray: add --ray local, --ray auto or an address")
        load = load_options(model, device, dtype, here=ray is None)  # workers load their own
        cluster = (
            ev.Cluster(ray, workers, cpus_per_worker, gpus_per_worker) if ray is not None else None
        )
        with eval_progress() as bar:

            def progress(label: str, clips: int):
                task_id = bar.add_task(label, total=clips)
                return lambda done: bar.update(task_id, completed=done)

            result = ev.evaluate(
                qa_file,
                names,
                levels,
                out,
                settings,
                load,
                limit,
                fresh,
                task,
                media,
                progress,
                cluster,
            )
        if as_json:
            fields = (
                "method",
                "budget",
                "budget_tokens",
                "protocol",
                "kv_bits",
                "kept",
                "accuracy",
                "by_type",
                "n",
            )
            runs = [{k: r.get(k) for k in fields} for r in result["runs"]]
            for shown, r in zip(runs, result["runs"]):
                if "by_split" in r:  # the benchmark's own parts, where it has them
                    shown["by_split"] = r["by_split"]
            ray_keys = ("videos", "failed", "workers", "pool_seconds")
            on_ray = {k: result[k] for k in ray_keys if k in result}
            emit_json({"runs": runs, "plot": result["plot"], **on_ray})
        else:
            show_eval(result["runs"], result["plot"])
            if "workers" in result:
                show_workers(result)
        if result.get("failed"):
            raise typer.Exit(1)

    run(body)


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
    world: str = typer.Option(
        "demo",
        "--world",
        help="demo: one centred shape a frame; grid: small moving shapes on a textured "
        "background (for the demo-grid backbone), with 'where' questions.",
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Write synthetic shape clips and their questions (qa.jsonl, the `mmkv eval` format)."""

    def body() -> None:
        from mmkv_cli.cli.display import out_console
        from mmkv_cli.cli.literal import plain
        from mmkv_cli.study.synth import write_dataset

        info = write_dataset(
            out_dir, clips, frames, seed, fps, kind=kind.value, force=force, world_name=world
        )
        if as_json:
            emit_json(info)
        else:
            out_console.print(
                plain(
                    f"wrote {info['clips']} clips of {frames} frames and {info['questions']} "
                    f"questions to {info['folder']}"
                )
            )

    run(body)
