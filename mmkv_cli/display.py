"""Rich renderings for the terminal; the --json paths never come through here."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

err_console = Console(stderr=True)
out_console = Console()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def encode_progress() -> Progress:
    return Progress(TextColumn("[bold]encode"), BarColumn(), MofNCompleteColumn(), TextColumn("frames"),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err_console, transient=True)


def show_inspect(info: dict) -> None:
    table = Table(title=f"{info['path']}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value")
    kept, total = info["visual_tokens_kept"], info["visual_tokens_total"]
    rows = [
        ("format", f"kvpack v{info['format_version']}"),
        ("model", f"{info['model']} ({info['family']})"),
        ("method", f"{info['method']} (budget {info['budget']:g})"),
        ("media", f"{info['media']['kind']} {info['media']['source']} ({info['media']['frames']} frames)"),
        ("blocks", str(info["blocks"])),
        ("visual tokens", f"{kept} kept of {total} ({100 * kept / max(total, 1):.1f}%)"),
        ("prompt tokens", str(info["prompt_tokens"])),
        ("size", f"{human_bytes(info['bytes'])} on disk, {human_bytes(info['kv_bytes'])} visual KV"),
        ("positions", f"{info['positions']['dims']}-D, question starts at {info['positions']['next_position']}"),
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
    for layer in info["layers"]:
        layers.add_row(str(layer["index"]), str(layer["tokens_kept"]))
    out_console.print(layers)


def show_profile(result: dict) -> None:
    ref = result["reference"]
    table = Table(title=f"profile: {result['model']} on {result['device']} (ratios to {ref})", title_justify="left")
    for col in ("method", "budget", "encode", "pack", "tokens kept", "peak mem", "peak KV", "TTFT", "decode/tok"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in result["methods"]:
        ratio = r["ratio"]

        def cell(value: str, metric: str) -> str:
            return value if ratio[metric] is None else f"{value} ({ratio[metric]:.2f}x)"

        table.add_row(r["method"], f"{r['budget']:g}", cell(f"{r['encode_s']:.2f}s", "encode_s"),
                      cell(human_bytes(r["bytes"]), "bytes"),
                      cell(f"{r['visual_tokens_kept']}/{r['visual_tokens_total']}", "visual_tokens_kept"),
                      cell(human_bytes(r["peak_mem_bytes"]), "peak_mem_bytes"),
                      cell(human_bytes(r["peak_kv_bytes"]), "peak_kv_bytes"),
                      cell(f"{1000 * r['ttft_s']:.1f}ms", "ttft_s"),
                      cell(f"{1000 * r['decode_s_per_token']:.1f}ms", "decode_s_per_token"))
    out_console.print(table)


def show_listing(title: str, rows: list[dict], columns: list[str]) -> None:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    out_console.print(table)
