"""`mmkv config`: every value the config file may set, its value now and where it came from; and
the file's values as the commands' defaults (serve's options, the packs folder)."""

from __future__ import annotations

import dataclasses
import inspect
import os
from pathlib import Path

import typer

from mmkv_cli.cli.common import JsonOpt, emit_json, run
from mmkv_cli.cli.talk import serve
from mmkv_cli.core.config import Config, ServeConfig, config, config_path, file_values
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.core.spec import as_plain, describe

# what each top-level key stands for when the file leaves it unset, and the variable that names it
BUILT_IN = {
    "device": LoadOptions.device,
    "dtype": LoadOptions.dtype,
    "packs": ".",
    "log_level": "warning",
}
ENVIRONMENT = {"model": "MMKV_MODEL", "presets": "MMKV_PRESETS", "log_level": "MMKV_LOG"}


def command_defaults() -> dict:
    """The click default_map the file makes: serve's options, and the packs folder of serve and ls
    (a value on the command line still wins)."""
    chosen = config()
    serve = {k: as_plain(v) for k, v in dataclasses.asdict(chosen.serve).items() if v is not None}
    if chosen.packs:
        serve["packs"] = chosen.packs
    return {"serve": serve, **({"ls": {"folder": chosen.packs}} if chosen.packs else {})}


def rows(read: bool = True) -> list[dict]:
    """Every key, its value, where it came from and its meaning (read: False, the defaults, the
    file left unread)."""
    from mmkv_cli.backbones.spec import PAPERS_MODEL, default_model

    chosen, written = (config(), file_values()) if read else (Config(), {})
    out = []
    for field in describe(Config):
        key = field["name"]
        if key == "serve":
            continue
        value, source = getattr(chosen, key), "config" if key in written else "default"
        if key == "model":
            value = default_model() if read else PAPERS_MODEL
        variable = ENVIRONMENT.get(key)
        if variable and os.environ.get(variable):
            value, source = os.environ[variable], variable
        elif value is None:
            value = BUILT_IN.get(key)
        out.append({"key": key, "value": value, "from": source, "doc": field["doc"]})
    options = {  # serve's own defaults, as its options declare them
        name: parameter.default.default
        for name, parameter in inspect.signature(serve).parameters.items()
    }
    for field in describe(ServeConfig):
        key = f"serve.{field['name']}"
        value = getattr(chosen.serve, field["name"])
        source = "config" if key in written else "default"
        value = options.get(field["name"]) if value is None else as_plain(value)
        out.append({"key": key, "value": value, "from": source, "doc": field["doc"]})
    return out


# what a key with no default is set to in the template, to show its form
EXAMPLES = {
    "presets": "~/mmkv-presets",
    "keep_alive": "5m",
    "host": "/run/user/1000/mmkv/mmkv.sock",
    "serve.cors": ["http://localhost:3000"],
    "serve.cache_gb": 8.0,
}


def template() -> str:
    """A config file with every key commented out, each with its meaning and a value in TOML: the
    one in effect, or an example of its form; a line uncommented is a valid setting."""
    import json

    values = {row["key"]: row["value"] for row in rows(read=False)}

    def line(key: str) -> str:
        value = values.get(key)
        value = EXAMPLES.get(key) if value is None else value
        shown = str(value).lower() if isinstance(value, bool) else json.dumps(value)
        return f"# {key.removeprefix('serve.')} = {shown}"

    lines = ["# mmkv's config (`mmkv config` shows what is in effect); uncomment to set.", ""]
    for field in describe(Config):
        if field["name"] != "serve":
            lines += [f"# {field['doc']}", line(field["name"]), ""]
    lines.append("[serve]")
    for field in describe(ServeConfig):
        lines += [f"# {field['doc']}", line(f"serve.{field['name']}")]
    return "\n".join(lines) + "\n"


def config_command(
    init: bool = typer.Option(
        False, "--init", help="Write a config file with every key commented out, if none is there."
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Show the config file's path and every setting in effect, with where it came from.

    The file is TOML at $MMKV_CONFIG, else ~/.config/mmkv/config.toml; a value on the command line
    wins over an environment variable, which wins over the file."""

    def body() -> None:
        from mmkv_cli.cli.display import show_config
        from mmkv_cli.core.errors import output_exists

        path = config_path()
        if init:
            if path.exists():
                raise output_exists(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(template(), encoding="utf-8")
        found = rows()
        if as_json:
            emit_json({"path": str(path), "exists": path.is_file(), "settings": found})
        else:
            show_config(path, found)

    run(body)
