"""Rich renderings of what the study commands measure (`profile`, `eval`): narrow tables that fit
an 80-column terminal; the --json paths never come through here."""

from __future__ import annotations

import math

from rich import box
from rich.table import Table

from mmkv_cli.cli.display import err_console, human_bytes, out_console, short_label
from mmkv_cli.cli.literal import plain


def show_workers(result: dict) -> None:
    """What each Ray worker did, and the videos that failed (each with its one line)."""
    table = Table(title=f"on Ray: {result['videos']} videos", title_justify="left")
    for column in ("worker", "videos", "seconds"):
        table.add_column(column, justify="left" if column == "worker" else "right", no_wrap=True)
    for name, did in sorted(result["workers"].items()):
        table.add_row(name, str(did["videos"]), f"{did['seconds']:.1f}")
    out_console.print(table)
    for failure in result["failed"]:
        out_console.print(plain(f"failed: {failure['video']}: {failure['error']}"))


def show_eval(runs: list[dict], figure: str) -> None:
    """Accuracy per run with its standard error, then per question type in a table of its own (two
    narrow tables fit 80 columns where one wide one cut its cells); the last row is chance level.
    `kept`: the share of visual KV the packs held, measured. Runs streamed and runs replayed answer
    from different memories: each protocol gets tables of its own, and a line says which ran how."""
    protocols = list(dict.fromkeys(r.get("protocol", "replay") for r in runs))
    if len(protocols) > 1:
        by = {p: dict.fromkeys(r["method"] for r in runs if r.get("protocol", "replay") == p)
              for p in protocols}  # fmt: skip
        chosen = "; ".join(f"{p}: {', '.join(methods)}" for p, methods in by.items())
        out_console.print(
            plain(f"protocols ({chosen}): a streamed and a replayed accuracy are not comparable")
        )
    for protocol in protocols:
        chosen = [r for r in runs if r.get("protocol", "replay") == protocol]
        _eval_tables(chosen, f" ({protocol})" if len(protocols) > 1 else "")
    out_console.print(plain(f"plot: {figure}"))


def standard_error(accuracy: float, n: int) -> float:
    """The binomial standard error of an accuracy over n questions."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / n) if n else 0.0


def _eval_tables(runs: list[dict], which: str) -> None:
    types = list(dict.fromkeys(t for r in runs for t in r["by_type"]))
    first = runs[0]["by_type"] if runs else {}
    chances = [first.get(t, {}).get("chance") for t in types]
    overall = (
        sum(c * first[t]["n"] for c, t in zip(chances, types)) / runs[0]["n"]
        if runs and all(c is not None for c in chances)
        else None
    )
    columns = ("method", "budget", "protocol", "kept", "n", "all", "se")
    summary = _eval_table(f"eval: accuracy{which}", columns)
    by_type = _eval_table(f"accuracy by question type{which}", ("method", "budget", *types))
    # the benchmark's own parts (OVO-Bench, StreamingBench), as its tables give them
    parts = list(dict.fromkeys(s for r in runs for s in r.get("by_split", {})))
    by_part = _eval_table(f"accuracy by the benchmark's part{which}", ("method", "budget", *parts))
    for r in runs:
        kept = f"{r['kept']:.2f}" if r.get("kept") is not None else "-"
        budget = f"{r['budget_tokens']}t" if r.get("budget_tokens") else f"{r['budget']:g}"
        protocol = r.get("protocol", "replay")
        se = f"{standard_error(r['accuracy'], r['n']):.2f}"
        summary.add_row(
            r["method"], budget, protocol, kept, str(r["n"]), f"{r['accuracy']:.2f}", se
        )
        by_type.add_row(
            r["method"],
            budget if protocol == "replay" else f"{budget} {protocol}",
            *(f"{r['by_type'][t]['accuracy']:.2f}" if t in r["by_type"] else "-" for t in types),
        )
        held = r.get("by_split", {})
        by_part.add_row(
            r["method"],
            budget,
            *(f"{held[p]['accuracy']:.2f}" if p in held else "-" for p in parts),
        )
    dim = [f"[dim]{c:.2f}[/dim]" if c is not None else "-" for c in (overall, *chances)]
    summary.add_row("[dim]chance[/dim]", "", "", "", "", dim[0], "")
    by_type.add_row("[dim]chance[/dim]", "", *dim[1:])
    out_console.print(summary)
    out_console.print(by_type)
    if parts:
        out_console.print(by_part)


def _eval_table(title: str, columns: tuple) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    return table


UNMEASURED_DECODE = (
    "note: every answer was one token, so no decode time per token was measured "
    "(a question with a longer answer measures it)"
)


def show_profile(result: dict) -> None:
    """Two narrow tables, measurements then ratios, so both fit an 80-column terminal."""
    columns = [
        ("encode", "encode_s", lambda v: f"{v:.2f}s"),
        ("pack", "bytes", human_bytes),
        ("kept", "visual_tokens_kept", str),
        ("peak mem", "peak_mem_bytes", human_bytes),
        ("peak KV", "peak_kv_bytes", human_bytes),
        ("TTFT", "ttft_s", duration),
        ("per tok", "decode_s_per_token", duration),  # decode time per token after the first
    ]
    from mmkv_cli.study.profile import label as run_label

    runs = result["methods"]
    if all(r["decode_s_per_token"] is None for r in runs):  # an empty column says nothing
        columns = [c for c in columns if c[1] != "decode_s_per_token"]
        err_console.print(plain(UNMEASURED_DECODE))
    repeat = runs[0].get("repeat", 1) if runs else 1
    each = (
        f", medians of {repeat} runs" if repeat > 1 else ", one run each (--repeat N for medians)"
    )
    labels = [run_label(r) for r in runs]
    measured = [[_cell(r[key], fmt) for r in runs] for _, key, fmt in columns]
    ratios = [[_cell(r["ratio"][key], "{:.2f}".format) for r in runs] for _, key, _ in columns]
    titles = (
        f"profile: {result['model']} on {result['device']}{each}",
        f"ratio to {result['reference']}",
    )
    for title, cells in zip(titles, (measured, ratios)):
        # a rule under the header, one space between columns, headings no wider than their
        # figures: eight columns fit 80, and a figure is never split
        out_console.print(plain(title))  # apart: a long title would widen the table
        table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)
        headings = ["method", *(heading for heading, _, _ in columns)]
        for heading, column in zip(headings, [labels, *cells]):
            justify = "left" if heading == "method" else "right"
            width = max(map(len, column), default=1)
            table.add_column(heading, justify=justify, min_width=width, no_wrap=True)
        for row in zip(labels, *cells):
            table.add_row(*row)
        out_console.print(table)
        out_console.print()
    if any(r.get("kv_bits", 16) != 16 for r in runs):
        show_quantization(result)


def duration(seconds: float) -> str:
    """Milliseconds under a second (12.3ms), seconds from there (12.35s): seven characters at most
    below 1,000 s, so a profile's eight columns fit 80."""
    return f"{1000 * seconds:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _cell(value, fmt) -> str:
    return "-" if value is None else fmt(value)


def show_quantization(result: dict) -> None:
    """How far quantization moved each method's first answer token from the same method's pack at
    the first bits profiled."""
    first = result["methods"][0].get("kv_bits", 16)
    table = Table(title=f"first answer token against {first} bits", title_justify="left")
    for col in ("method", "bits", "pack", "KL (nats)", "top-1"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in result["methods"]:
        table.add_row(
            short_label(r),
            str(r["kv_bits"]),
            human_bytes(r["bytes"]),
            f"{r['first_token_kl']:.5f}",
            "same" if r["top1_agrees"] else "differs",
        )
    out_console.print(table)
