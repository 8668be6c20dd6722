"""Typer command: mmkv batch (many media to packs, in-process or on Ray)."""

from __future__ import annotations

import time

import typer

from mmkv_cli.cli.common import (
    BudgetTokensOpt,
    CpusPerWorkerOpt,
    DeviceOpt,
    DtypeOpt,
    FpsOpt,
    GpusPerWorkerOpt,
    JsonOpt,
    KvBitsOpt,
    KvGroupOpt,
    MaxFramesOpt,
    ModelOpt,
    ReduceOpt,
    WorkersOpt,
    emit_json,
    load_options,
    method_names,
    ray_option,
    run,
)
from mmkv_cli.core.options import Dtype, EncodeOptions


def batch(
    manifest: str = typer.Argument(
        ...,
        help="A folder, a glob, a bucket prefix (s3://b/videos/), or a JSONL/CSV file with a media "
        "column and optional per-row options (method, budget, budget_tokens, fps, max_frames, "
        "kv_bits, kv_group, guidance_prompt, reduce, id).",
    ),
    out: str = typer.Option(
        ..., "--out", "-o", "--output", help="Folder or URL prefix the packs and batch.jsonl go to."
    ),
    method: str = typer.Option(
        "full",
        "--method",
        help="Memory policy or preset for every row without one.",
        autocompletion=method_names,
    ),
    budget: float | None = typer.Option(None, "--budget", help="Share of visual tokens kept."),
    budget_tokens: int | None = BudgetTokensOpt,
    fps: float | None = FpsOpt,
    max_frames: int | None = MaxFramesOpt,
    kv_bits: float | None = KvBitsOpt,
    kv_group: int = KvGroupOpt,
    reduce: str | None = ReduceOpt,
    ray: str | None = ray_option("the items"),
    workers: int = WorkersOpt,
    cpus_per_worker: float = CpusPerWorkerOpt,
    gpus_per_worker: float = GpusPerWorkerOpt,
    model: str | None = ModelOpt,
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Encode many media into content-addressed packs under OUT; a rerun skips what is done.

    One bad file fails only its row of OUT/batch.jsonl; the exit is 1 when any row failed."""

    def body() -> None:
        from mmkv_cli.batch.driver import run_batch, summary
        from mmkv_cli.batch.manifest import read_manifest
        from mmkv_cli.batch.run import BatchSettings
        from mmkv_cli.core.errors import MmkvError

        items = read_manifest(manifest)
        options = EncodeOptions(
            method,
            budget,
            budget_tokens,
            fps,
            max_frames,
            kv_bits=kv_bits,
            kv_group=kv_group,
            reduce=reduce,
        )
        load = load_options(model, device, dtype, here=ray is None)  # workers load their own
        settings = BatchSettings(load, options, out)
        started = time.perf_counter()
        with _progress() as progress:
            task = progress.add_task("batch", total=len(items), failed=0)

            def on_row(row: dict) -> None:
                failed = progress.tasks[0].fields["failed"] + (row["status"] == "failed")
                progress.update(task, advance=1, failed=failed)

            rows = run_batch(
                items,
                settings,
                ray=ray,
                workers=workers,
                cpus_per_worker=cpus_per_worker,
                gpus_per_worker=gpus_per_worker,
                on_row=on_row,
            )
        report = summary(rows, len(items), time.perf_counter() - started)
        emit_json(report) if as_json else _show(report, out)
        if report["failed"]:
            raise MmkvError(
                f"{report['failed']} of {len(items)} items failed "
                f"(see {out.rstrip('/')}/batch.jsonl)"
            )

    run(body)


def _progress():
    from mmkv_cli.cli.progress import counting_progress

    return counting_progress("batch", "items, {task.fields[failed]} failed")


def _show(report: dict, out: str) -> None:
    from rich import box
    from rich.table import Table

    from mmkv_cli.cli.display import human_bytes, out_console
    from mmkv_cli.cli.literal import plain

    table = Table(title=f"batch: {out}", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("items", "ok", "skipped", "failed", "written", "encoded/min"):
        table.add_column(column, justify="right")
    rate = report["items_per_minute"]
    table.add_row(
        *(str(report[k]) for k in ("items", "ok", "skipped", "failed")),
        human_bytes(report["bytes_written"]),
        "-" if rate is None else str(rate),
    )
    out_console.print(table)
    for failure in report["failures"]:
        out_console.print(plain(f"failed: {failure['media']}: {failure['error']}"))
