"""Rich renderings for the terminal; the --json paths never come through here."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mmkv_cli.cli.literal import plain, visible

err_console = Console(stderr=True)  # notes and progress: `-q` silences them
out_console = Console()
error_console = Console(stderr=True)  # the one line of a failure: never silenced


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}B" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def budget_label(info: dict) -> str:
    if info.get("budget_tokens"):
        return f"budget {info['budget_tokens']} tokens"
    if info.get("budget") is None:
        kept, prefilled = info.get("visual_tokens_kept"), info.get("visual_tokens_prefilled")
        fewer = kept is not None and prefilled is not None and kept < prefilled
        return "own sizes" if fewer else "keeps all"
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
    if info["kv_group"] is None:  # not quantized
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
    """Two lines that fit 80 columns, the file written, then what it keeps; a third when the
    encode took fewer frames than the media offers."""
    lines = (  # the path and method shown as they are: the line breaks are this function's own
        f"wrote {visible(info['path'])} ({human_bytes(info['bytes'])}, {info['blocks']} blocks) "
        f"in {info['encode_s']:.2f} s\n{visible(info['method'])} ({budget_label(info)}): "
        f"{kept_label(info)}{budget_note(info)}"
    )
    if not info.get("frames_offered"):
        return lines
    asked = info["max_frames"] if info.get("max_frames_by") == "option" else None
    return f"{lines}\n{thinning_note(info['media']['frames'], info['frames_offered'], asked)}"


def thinning_note(taken: int, offered: int, asked: int | None, verb: str = "took") -> str:
    """Frames an encode took of more: `asked` is --max-frames as given (None: the model's cap)."""
    cap = f"--max-frames {asked}" if asked is not None else f"the model's {taken} at most"
    return f"{verb} {taken} of {offered} frames, evenly spaced ({cap}; --max-frames 0 takes all)"


def budget_note(info: dict) -> str:
    """Said when a memory of a fixed size holds the whole stream: nothing was chosen, and a
    comparison at this budget compares nothing."""
    total, tokens = info["visual_tokens_total"], info.get("budget_tokens")
    if not tokens or total is None or info["visual_tokens_kept"] < total:
        return ""
    return f"; its budget of {tokens:,} tokens a layer keeps all {total:,} of this media"


def show_inspect(info: dict) -> None:
    # every string here may come from the pack or the file's name: shown as it is (cli/literal.py)
    table = Table(title=plain(info["path"]), show_header=False, title_justify="left")
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
    if info.get("embeddings_bytes"):  # v13: what a question's late interaction reads
        rows.append(("embeddings", f"{human_bytes(info['embeddings_bytes'])} (tokens as taken in)"))
    if info.get("hot"):
        hot = info["hot"]
        held = f"in the warm server: {human_bytes(hot['bytes'])} held, {hot['questions']} questions"
        rows.append(("hot", held))
    for field, value in rows:
        table.add_row(field, plain(value))
    out_console.print(table)
    grains = Table(title="blocks by granularity", title_justify="left")
    for col in ("granularity", "blocks", "tokens", "bytes"):
        grains.add_column(col, justify="right" if col != "granularity" else "left")
    for name, g in info["granularities"].items():
        grains.add_row(plain(name), str(g["blocks"]), str(g["tokens"]), human_bytes(g["bytes"]))
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


def show_start_here(rows: list[dict]) -> None:
    """The methods a newcomer picks first, each with when (the registry's start_here)."""
    picks = [row for row in rows if row.get("start_here")]
    if not picks:
        return
    out_console.print("start here", style="bold")
    widest = max(len(row["name"]) for row in picks)
    for row in picks:
        out_console.print(plain(f"  {row['name']:<{widest}}  {row['start_here']}"))
    out_console.print()


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
        table.add_row(*(plain(row.get(c, "")) for c in columns))
    out_console.print(table)


def show_models(rows: list[dict], default: str) -> None:
    """The presets by family, one line a model: its name, where it comes from and whether its
    weights are here; the description beside it where the terminal has room (wide ones)."""
    wide = out_console.width >= 120
    out_console.print(plain(f"models (default: {default})"))
    out_console.print("weights: built in, here, or hub (fetched on first use)", style="dim")
    for family in dict.fromkeys(row["family"] for row in rows):
        table = Table(title=family, title_justify="left", box=None, padding=(0, 1), pad_edge=False)
        for column in ("name", "source", "weights", *(("description",) if wide else ())):
            whole = column in ("name", "weights")  # a long local path folds, whole, over lines
            table.add_column(column, no_wrap=whole, overflow="fold", header_style="dim")
        for row in (r for r in rows if r["family"] == family):
            cells = [plain(row["name"]), plain(row["source"]), row["weights"]]
            table.add_row(*cells, *((plain(row["description"]),) if wide else ()))
        out_console.print(table)


def show_listing_of_packs(folder: str, rows: list[dict]) -> None:
    """One line a pack: the name one types, what it holds, its size and state."""
    if not rows:
        out_console.print(plain(f"no packs (*.kvpack) in {folder}"))
        return
    table = Table(
        title=plain(f"packs in {folder}"), title_justify="left", box=box.SIMPLE_HEAD,
        pad_edge=False, show_edge=False, padding=(0, 1, 0, 0),  # two spaces between columns
    )  # fmt: skip
    # one line a pack at 80 columns: the short cells whole, a fault's words folding in the last
    for column in ("pack", "model", "method", "media", "size"):
        table.add_column(column, no_wrap=column == "pack", overflow="ellipsis")
    table.add_column("state", overflow="fold")
    for row in rows:
        method = short_label(row) if "method" in row else "-"  # hermes@4096t, recency@0.5
        media = row.get("media") or "-"  # its frames: `inspect`
        state = row["state"]
        whole = state == "opens" or state.startswith("verified")
        shown = plain(state, style="" if whole else "red")  # a fault's words are not markup
        size = human_bytes(row["bytes"])
        model = plain(row.get("model") or "-")
        table.add_row(plain(row["name"]), model, plain(method), plain(media), size, shown)
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
    """Why the context holds what it holds: each block, its span (seconds of a video, pages of a
    document, images of a set) and, where retrieval chose it, its scores."""
    if not retrieved:
        err_console.print(f"[dim]no retrieval: the context holds {len(used)} stored blocks[/dim]")
        return
    scored = any(r["score"] is not None for r in retrieved)
    layered = "layers" in retrieved[0]  # per-layer retrieval: how many layers took each block
    title = "retrieved blocks (context order)" if scored else "context blocks (no retrieval)"
    table = Table(title=title)
    unit, seconds = SPAN_UNITS.get(kind or "video", ("time (s)", True))
    columns = ["block", "granularity", unit] + ["score", "reranked"] * scored + ["layers"] * layered
    for column in columns:
        table.add_column(column, justify="left" if column in columns[:3] else "right")
    for r in retrieved:
        row = [plain(r["block"]), plain(r["granularity"] or ""), _span(r.get("time"), seconds)]
        if scored:  # a block kept unscored (SAVEMem's short term), or never reranked: "-"
            row += [f"{r[key]:.3f}" if r[key] is not None else "-" for key in ("score", "reranked")]
        table.add_row(*row, *([str(r["layers"])] if layered else []))
    err_console.print(table)


def show_config(path, rows: list[dict]) -> None:
    """The config file's path, then one line a setting: key, value, where it came from; its
    meaning beside them where the terminal has room."""
    there = "" if path.is_file() else " (not there: `mmkv config --init` writes one)"
    out_console.print(plain(f"config file: {path}{there}"), soft_wrap=True)
    wide = out_console.width >= 120
    table = Table(box=None, padding=(0, 1), pad_edge=False)
    for column in ("key", "value", "from", *(("meaning",) if wide else ())):
        table.add_column(column, no_wrap=column != "value", overflow="fold", header_style="dim")
    for row in rows:
        value = row["value"]
        value = (
            "-" if value is None else ", ".join(value) if isinstance(value, list) else str(value)
        )
        cells = (row["key"], plain(value), plain(row["from"]))
        table.add_row(*cells, *((row["doc"],) if wide else ()))
    out_console.print(table)


def show_server(state: dict) -> None:
    """`mmkv ps`: the server, then its loaded models and hot packs (most recent first)."""
    alive = state.get("keep_alive_s", -1)
    leaves = "never leaves" if alive < 0 else f"leaves after {alive:g} s idle"
    out_console.print(
        plain(f"mmkv server {state.get('version')} (pid {state.get('pid')}) on {state['socket']}")
    )
    hot, cap = human_bytes(state.get("hot_bytes", 0)), human_bytes(state.get("cache_bytes", 0))
    out_console.print(
        Text(f"{leaves}; idle {state.get('idle_s', 0):.1f} s; hot packs {hot} of {cap}")
    )
    models = Table(title="models", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("model", "device", "dtype", "size"):
        models.add_column(column, no_wrap=column == "model", overflow="fold")
    for row in state.get("models", []):
        models.add_row(
            plain(row["model"]),
            str(row["device"]),
            str(row["dtype"]),
            human_bytes(row["bytes"]),
        )
    out_console.print(models if state.get("models") else Text("no model loaded"))
    packs = Table(title="hot packs", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("pack", "held", "in", "spans", "questions"):
        packs.add_column(column, no_wrap=column == "pack", overflow="fold")
    for row in state.get("packs", []):
        held, where = human_bytes(row["bytes"]), str(row.get("where", ""))
        cells = (held, where, str(row["spans"]), str(row["questions"]))
        packs.add_row(plain(row["path"]), *cells)
    out_console.print(packs if state.get("packs") else Text("no pack hot"))
