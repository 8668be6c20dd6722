"""`mmkv methods` and `mmkv models`: the registries as a user reads them (presets folded under
their method unless --all), or as JSON."""

from __future__ import annotations

import typer

from mmkv_cli.cli.common import JsonOpt, emit_json, run


def with_presets_folded(rows: list[dict]) -> list[dict]:
    """The methods in code, each naming its presets under its description."""
    presets: dict[str, list[str]] = {}
    for row in rows:
        if row["name"] != row["implements"]:
            presets.setdefault(row["implements"], []).append(row["name"])
    folded = [dict(row) for row in rows if row["name"] == row["implements"]]
    for row in folded:
        if row["name"] in presets:
            row["description"] += f"; presets: {', '.join(presets[row['name']])}"
    return folded


def methods(
    every: bool = typer.Option(False, "--all", help="A row for every preset too."),
    as_json: bool = JsonOpt,
) -> None:
    """List the compression methods (paper, default budget, parameters) and the token reducers."""

    def body() -> None:
        from mmkv_cli.cli.display import out_console, show_listing, show_start_here
        from mmkv_cli.core.spec import describe
        from mmkv_cli.methods.choice import method_listing
        from mmkv_cli.reduce import REDUCERS

        rows = method_listing()
        reducers = [
            {
                "name": name,
                "description": reducer.description,
                "paper": {"title": reducer.paper.title, "year": reducer.paper.year},
                "video_only": reducer.temporal,
                "reads_tower_attention": reducer.tower_attention,
                "reuses_tower_layers": reducer.tower_reuse is not None,
                "params": describe(reducer.params),
            }
            for name, reducer in REDUCERS.items()
        ]
        if as_json:
            emit_json({"methods": rows, "reducers": reducers})
        else:
            show_start_here(rows)
            pruning = [row["name"] for row in rows if "prune-at-ask" in row["abilities"]]
            shown = rows if every else with_presets_folded(rows)
            for row in shown:
                row["reducer"] = row["reduce"]["name"] if row["reduce"] else ""
            title = "methods and presets" if every else "methods (--all: a row for each preset)"
            show_listing(title, shown, ["name", "budget", "reducer", "description"])
            out_console.print(f"ask --prune takes: {', '.join(pruning)}", markup=False)
            show_listing("reducers (encode --reduce)", reducers, ["name", "description"])

    run(body)


def models(as_json: bool = JsonOpt) -> None:
    """List the model presets (any HF id or local path of a supported family works too)."""

    def body() -> None:
        from mmkv_cli.backbones.spec import default_model, model_listing
        from mmkv_cli.cli.display import show_models

        rows = model_listing()
        if as_json:
            emit_json({"models": rows, "default": default_model()})
        else:
            show_models(rows, default_model())

    run(body)
