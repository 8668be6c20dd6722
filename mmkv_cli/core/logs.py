"""mmkv's log records: one logger tree under `mmkv`, silent unless an application configures it (as
the standard library advises a library to be). The CLI does: `-v` info, `-vv` debug, `-q` errors
only, `--log-level` or `MMKV_LOG` by name, through rich's handler on stderr (cli/display.py)."""

from __future__ import annotations

import logging

from mmkv_cli.core.errors import UsageError

logging.getLogger("mmkv").addHandler(logging.NullHandler())

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
LEVELS.update(error=logging.ERROR, critical=logging.CRITICAL)


def get(module: str) -> logging.Logger:
    """The logger of a module of mmkv_cli: `mmkv.<its path>` (mmkv_cli.backbones.loading ->
    mmkv.backbones.loading), so `logging.getLogger("mmkv")` holds them all."""
    return logging.getLogger("mmkv." + module.removeprefix("mmkv_cli."))


def level_named(name: str, where: str) -> int:
    """A level by name (debug, info, warning, error, critical; any case)."""
    level = LEVELS.get(name.strip().lower())
    if level is None:
        raise UsageError(f"{where} must be one of {', '.join(LEVELS)}, not '{name}'")
    return level
