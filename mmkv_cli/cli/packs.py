"""Typer commands that work on packs alone, without a model: convert, verify, ls."""

from __future__ import annotations

import typer

from mmkv_cli.cli.common import JsonOpt, emit_json, run


def convert(
    source: str = typer.Argument(..., help="The .kvpack to convert."),
    output: str = typer.Argument(..., help="The .kvpack to write."),
    kv_bits: float | None = typer.Option(
        None,
        "--kv-bits",
        help="Bits per stored visual K/V value: 16 (as computed), 8, 4, 2 or 1.5 (default: the "
        "source's).",
    ),
    kv_group: int | None = typer.Option(
        None,
        "--kv-group",
        help="With --kv-bits: tokens per key group, channels per value group (default: 128).",
    ),
    start: float | None = typer.Option(
        None, "--start", "--from", help="Keep only blocks showing this second or later."
    ),
    stop: float | None = typer.Option(
        None, "--stop", "--to", help="Keep only blocks showing this second or earlier."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an existing output; allow raising the precision."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Store a pack's KV at other bits, or cut out a time range, without the model.

    The new pack is written atomically; the source is never touched."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.cli.display import converted_line, out_console
        from mmkv_cli.cli.literal import plain

        info = api.convert(source, output, api.convert_quant(kv_bits, kv_group), start, stop, force)
        emit_json(info) if as_json else out_console.print(plain(converted_line(info)))

    run(body)


def verify(pack: str = typer.Argument(..., help="A .kvpack."), as_json: bool = JsonOpt) -> None:
    """Read and check every byte of a pack; report each fault (block, tensor) and exit 4 on any.

    `inspect` stays lazy: it reads the header and table only."""

    def body() -> None:
        from mmkv_cli import api
        from mmkv_cli.cli.display import human_bytes, out_console
        from mmkv_cli.cli.literal import plain
        from mmkv_cli.core.errors import PackError

        report = api.verify(pack)
        if as_json:
            emit_json(report)
        elif report["ok"]:
            checked = (
                f"{report['path']}, {report['blocks']} blocks, "
                f"{human_bytes(report['bytes_checked'])} checked"
            )
            unverifiable = ", ".join(report["unverifiable"])
            out_console.print(
                plain(
                    f"ok: {checked}"
                    if not unverifiable
                    else f"ok as far as format v{report['format_version']} can tell: {checked}; "
                    f"it has no checksum over {unverifiable} (checked for shape and sense only)"
                )
            )
        else:
            for fault in report["faults"]:
                out_console.print(plain(f"fault: {fault}"))
        if not report["ok"]:
            count = len(report["faults"])
            raise PackError(f"{report['path']}: {count} fault{'' if count == 1 else 's'}")

    run(body)


def ls(
    folder: str = typer.Argument(".", help="A folder of packs."),
    check: bool = typer.Option(
        False, "--verify", help="Read and check every byte of each (as verify does)."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """List the packs of a folder: model, method, media, size and state.

    The state says whether each opens; with --verify, whether every byte of it is whole."""

    def body() -> None:
        from mmkv_cli.api import listing
        from mmkv_cli.cli.display import show_listing_of_packs

        rows = listing(folder, check)
        emit_json(rows) if as_json else show_listing_of_packs(folder, rows)

    run(body)
