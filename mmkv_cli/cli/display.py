"""Rich renderings for the terminal; the --json paths never come through here."""

from __future__ import annotations

import math
from contextlib import contextmanager

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

err_console = Console(stderr=True)  # notes and progress: `-q` silences them
out_console = Console()
error_console = Console(stderr=True)  # the one line of a failure: never silenced


def show_logs(level: int, quiet: bool) -> None:
    """mmkv's log records at `level` and above on stderr through rich's handler; quiet: the notes
    and progress bars go too, leaving answers and errors."""
    import logging

    from rich.logging import RichHandler

    err_console.quiet = quiet
    handler = RichHandler(
        console=error_console,
        show_time=level <= logging.DEBUG,
        show_path=False,
        markup=False,
        rich_tracebacks=False,
    )
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger("mmkv")
    root.handlers = [h for h in root.handlers if not isinstance(h, RichHandler)] + [handler]
    root.setLevel(level)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}B" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def encode_progress() -> Progress:
    return Progress(
        TextColumn("[bold]encode"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("frames"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    )


def counting_progress(label: str, unit: str) -> Progress:
    """A transient bar on stderr counting `unit` done of a total, with the time taken and an ETA
    (label and unit may name task fields: {task.description}, {task.fields[failed]})."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )


def eval_progress() -> Progress:
    return counting_progress("{task.description}", "clips")


def show_workers(result: dict) -> None:
    """What each Ray worker did, and the videos that failed (each with its one line)."""
    table = Table(title=f"on Ray: {result['videos']} videos", title_justify="left")
    for column in ("worker", "videos", "seconds"):
        table.add_column(column, justify="left" if column == "worker" else "right", no_wrap=True)
    for name, did in sorted(result["workers"].items()):
        table.add_row(name, str(did["videos"]), f"{did['seconds']:.1f}")
    out_console.print(table)
    for failure in result["failed"]:
        out_console.print(f"failed: {failure['video']}: {failure['error']}", highlight=False)


def show_eval(runs: list[dict], figure: str) -> None:
    """Accuracy per run with its standard error, then per question type in a table of its own (two
    narrow tables fit 80 columns where one wide one cut its cells); the last row is chance level.
    `kept`: the share of visual KV the packs held, measured. Runs streamed and runs replayed answer
    from different memories: each protocol gets tables of its own, and a line says which ran how."""
    protocols = list(dict.fromkeys(r.get("protocol", "replay") for r in runs))
    if len(protocols) > 1:
        chosen = "; ".join(
            f"{p}: {', '.join(r['method'] for r in runs if r.get('protocol', 'replay') == p)}"
            for p in protocols
        )
        out_console.print(
            f"protocols ({chosen}): a streamed and a replayed accuracy are not comparable",
            highlight=False,
        )
    for protocol in protocols:
        chosen = [r for r in runs if r.get("protocol", "replay") == protocol]
        _eval_tables(chosen, f" ({protocol})" if len(protocols) > 1 else "")
    out_console.print(f"plot: {figure}", highlight=False)


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
    dim = [f"[dim]{c:.2f}[/dim]" if c is not None else "-" for c in (overall, *chances)]
    summary.add_row("[dim]chance[/dim]", "", "", "", "", dim[0], "")
    by_type.add_row("[dim]chance[/dim]", "", *dim[1:])
    out_console.print(summary)
    out_console.print(by_type)


def _eval_table(title: str, columns: tuple) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0))
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    return table


def budget_label(info: dict) -> str:
    if info.get("budget_tokens"):
        return f"budget {info['budget_tokens']} tokens"
    if info.get("budget") is None:
        return "keeps all"
    return f"budget {info['budget']:g}"


def short_label(info: dict) -> str:
    """method@budget for narrow tables: recency@0.25, hermes@4096t, full."""
    if info.get("budget_tokens"):
        return f"{info['method']}@{info['budget_tokens']}t"
    return info["method"] if info.get("budget") is None else f"{info['method']}@{info['budget']:g}"


def kept_label(info: dict) -> str:
    """What the pack holds of the stream, truthfully: the KV share averaged over layers, and for
    packs that cut the stream several ways (MuKV), each view's share, since the views overlap."""
    kept, total = info["visual_tokens_kept"], info["visual_tokens_total"]
    if total is None:  # a pack that does not record the stream's length
        return f"{kept:g} visual tokens per layer"
    share = f"{kept:g} of {total} visual tokens per layer ({100 * kept / max(total, 1):.1f}%)"
    views = info.get("overlapping_views") or []
    if not views:
        return share
    parts = ", ".join(f"{v} {info['granularities'][v]['stream_share']:.2f}" for v in views)
    return f"{share}, as {len(views)} overlapping views of the stream ({parts})"


def prefilled_label(info: dict) -> str:
    """Tokens the media gave against those the language model was run on (a reducer's cut)."""
    total, prefilled = info["visual_tokens_total"], info["visual_tokens_prefilled"]
    if total is None or prefilled is None:
        return "not recorded"
    reducer = f", reducer {info['reduce']}" if info.get("reduce") else ""
    share = 100 * prefilled / max(total, 1)
    return f"{prefilled} of {total} visual tokens seen ({share:.1f}%){reducer}"


def storage_label(info: dict) -> str:
    """How the visual KV is stored: bits, group and bytes per token per layer."""
    per_token = f"{info['kv_bytes_per_token']:g} bytes a token per layer"
    if info["kv_bits"] == 16:
        return f"{info['kv_dtype']}, as computed, {per_token}"
    ratio = info["kv_bytes_per_token"] / max(1, info["kv_bytes_per_token_as_computed"])
    return (
        f"{info['kv_bits']}-bit, groups of {info['kv_group']} (fp16 scale and zero), {per_token} "
        f"({ratio:.1%} of {info['kv_dtype']})"
    )


def converted_line(info: dict) -> str:
    bits = "as computed" if info["kv_bits"] == 16 else f"{info['kv_bits']}-bit"
    return (
        f"wrote {info['path']}: {info['blocks']} of {info['source_blocks']} blocks, {bits}, "
        f"{human_bytes(info['bytes'])} ({info['bytes'] / info['source_bytes']:.1%} of the source)"
    )


def encoded_line(info: dict) -> str:
    """Two lines that fit 80 columns: the file written, then what it keeps."""
    return (
        f"wrote {info['path']} ({human_bytes(info['bytes'])}, {info['blocks']} blocks) in "
        f"{info['encode_s']:.2f} s\n{info['method']} ({budget_label(info)}): {kept_label(info)}"
        f"{budget_note(info)}"
    )


def budget_note(info: dict) -> str:
    """Said when a memory of a fixed size holds the whole stream: nothing was chosen, and a
    comparison at this budget compares nothing."""
    total, tokens = info["visual_tokens_total"], info.get("budget_tokens")
    if not tokens or total is None or info["visual_tokens_kept"] < total:
        return ""
    return f"; its budget of {tokens:,} tokens a layer keeps all {total:,} of this media"


def show_inspect(info: dict) -> None:
    table = Table(title=f"{info['path']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("format", f"kvpack v{info['format_version']}"),
        ("model", f"{info['model']} ({info['family']})"),
        ("method", f"{info['method']} ({budget_label(info)})"),
        (
            "media",
            f"{info['media']['kind']} {info['media']['source']} ({info['media']['frames']} frames)",
        ),
        ("blocks", str(info["blocks"])),
        ("prefilled", prefilled_label(info)),
        ("visual tokens", kept_label(info)),
        ("prompt tokens", str(info["prompt_tokens"])),
        (
            "size",
            f"{human_bytes(info['bytes'])} on disk, {human_bytes(info['kv_bytes'])} visual KV",
        ),
        ("KV storage", storage_label(info)),
        (
            "positions",
            f"{info['positions']['dims']}-D, "
            f"question starts at {info['positions']['next_position']}",
        ),
        ("created", info["created"]),
    ]
    for row in rows:
        table.add_row(*row)
    out_console.print(table)
    grains = Table(title="blocks by granularity", title_justify="left")
    for col in ("granularity", "blocks", "tokens", "bytes"):
        grains.add_column(col, justify="right" if col != "granularity" else "left")
    for name, g in info["granularities"].items():
        grains.add_row(name, str(g["blocks"]), str(g["tokens"]), human_bytes(g["bytes"]))
    out_console.print(grains)
    layers = Table(title="tokens kept per layer", title_justify="left")
    layers.add_column("layer", justify="right")
    layers.add_column("visual tokens kept", justify="right")
    if info["per_head"]:  # each KV head keeps its own: the layer's figure is their mean
        layers.add_column("per KV head", justify="right")
    for layer in info["layers"]:
        heads = [" ".join(map(str, layer["heads"]))] if info["per_head"] else []
        layers.add_row(str(layer["index"]), str(layer["tokens_kept"]), *heads)
    out_console.print(layers)


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
        out_console.print(title, highlight=False)  # apart: a long title would widen the table
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


def show_listing(title: str, rows: list[dict], columns: list[str]) -> None:
    """Rows under `columns`; the first column holds names one types, so it is never cut or wrapped,
    and the others fold (whole, over lines) rather than end in an ellipsis."""
    table = Table(title=title, title_justify="left")
    widest = max((len(str(row.get(columns[0], ""))) for row in rows), default=0)
    for i, col in enumerate(columns):
        if i == 0:
            table.add_column(col, no_wrap=True, min_width=max(widest, len(col)))
        else:  # words wrap; a long identifier (an HF id) folds instead of ending in '…'
            table.add_column(col, overflow="fold" if col == "source" else "ellipsis")
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    out_console.print(table)


def show_models(rows: list[dict], default: str) -> None:
    """The presets by family, one line a model: its name, where it comes from and whether its
    weights are here; the description beside it where the terminal has room (wide ones)."""
    wide = out_console.width >= 120
    out_console.print(f"models (default: {default})", highlight=False)
    out_console.print("weights: built in, here, or hub (fetched on first use)", style="dim")
    for family in dict.fromkeys(row["family"] for row in rows):
        table = Table(title=family, title_justify="left", box=None, padding=(0, 1), pad_edge=False)
        for column in ("name", "source", "weights", *(("description",) if wide else ())):
            whole = column in ("name", "weights")  # a long local path folds, whole, over lines
            table.add_column(column, no_wrap=whole, overflow="fold", header_style="dim")
        for row in (r for r in rows if r["family"] == family):
            cells = [Text(row["name"]), Text(row["source"]), row["weights"]]
            table.add_row(*cells, *((row["description"],) if wide else ()))
        out_console.print(table)


def show_listing_of_packs(folder: str, rows: list[dict]) -> None:
    """One line a pack: the name one types, what it holds, its size and state."""
    if not rows:
        out_console.print(f"no packs (*.kvpack) in {folder}", highlight=False)
        return
    table = Table(title=f"packs in {folder}", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("pack", "model", "method", "media", "size", "state"):
        table.add_column(column, no_wrap=column == "pack", overflow="fold")
    for row in rows:
        method = f"{row['method']} ({budget_label(row)})" if "method" in row else "-"
        media = f"{row['media']} ({row['frames']})" if row.get("media") else "-"
        state = row["state"]
        whole = state == "opens" or state.startswith("verified")
        shown = Text(state, style="" if whole else "red")  # a fault's words are not markup
        size = human_bytes(row["bytes"])
        table.add_row(Text(row["name"]), row.get("model") or "-", method, media, size, shown)
    out_console.print(table)


# what a block's span is measured in, by the pack's media kind: seconds, or page / image indices
SPAN_UNITS = {"pdf": ("pages", False), "images": ("images", False)}


def _span(time: list | None, seconds: bool) -> str:
    if not time:
        return "-"
    if seconds:
        return f"{time[0]:.1f}-{time[1]:.1f}"
    first, last = int(time[0]), int(time[1])
    return str(first) if first == last else f"{first}-{last}"


def show_retrieved(retrieved: list[dict], used: list[str], kind: str | None = "video") -> None:
    """Why the context holds what it holds: each retrieved block, its span (seconds of a video,
    pages of a document, images of a set) and its scores."""
    if not retrieved:
        err_console.print(
            f"[dim]no retrieval: the context holds all {len(used)} stored blocks[/dim]"
        )
        return
    layered = "layers" in retrieved[0]  # per-layer retrieval: how many layers took each block
    table = Table(title="retrieved blocks (context order)")
    unit, seconds = SPAN_UNITS.get(kind or "video", ("time (s)", True))
    columns = ["block", "granularity", unit, "score", "reranked"] + ["layers"] * layered
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:3] else "right")
    for r in retrieved:
        span = _span(r.get("time"), seconds)
        row = [r["block"], r["granularity"], span, f"{r['score']:.3f}", f"{r['reranked']:.3f}"]
        table.add_row(*row, *([str(r["layers"])] if layered else []))
    err_console.print(table)


@contextmanager
def questions_progress(total: int):
    """A bar on stderr over the questions answered, with an ETA; yields tick(answered)."""
    bar = counting_progress("questions", "")
    task = bar.add_task("questions", total=total)
    with bar:
        yield lambda done: bar.update(task, completed=done)


def show_config(path, rows: list[dict]) -> None:
    """The config file's path, then one line a setting: key, value, where it came from; its
    meaning beside them where the terminal has room."""
    there = "" if path.is_file() else " (not there: `mmkv config --init` writes one)"
    out_console.print(f"config file: {path}{there}", highlight=False, soft_wrap=True)
    wide = out_console.width >= 120
    table = Table(box=None, padding=(0, 1), pad_edge=False)
    for column in ("key", "value", "from", *(("meaning",) if wide else ())):
        table.add_column(column, no_wrap=column != "value", overflow="fold", header_style="dim")
    for row in rows:
        value = row["value"]
        value = (
            "-" if value is None else ", ".join(value) if isinstance(value, list) else str(value)
        )
        table.add_row(row["key"], Text(value), row["from"], *((row["doc"],) if wide else ()))
    out_console.print(table)
