"""torch, imported on its first use rather than at import time.

`mmkv --help`, `mmkv methods` and `inspect` of a local pack touch method and pack modules but
never a tensor op, and importing torch costs seconds. Modules that may be imported on those fast
paths take `torch` from here: a plain object that imports the real module the first time one of
its attributes is read, then forwards every read to it.

Nothing is ever put in `sys.modules` under torch's name. The standard library's LazyLoader did
that, and since CPython 3.12.3 / 3.13 (gh-114763) torch's own `__init__` ran against the stand-in,
recursed in its `__delattr__` and left a half-initialised torch behind for every later import.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class Deferred:
    """A module named now, imported when an attribute is first read (`torch.zeros` imports torch).

    `import torch` elsewhere, before or after, gets the one real module: this object is not it.
    """

    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def __getattr__(self, attribute: str):
        module = self._module
        if module is None:
            from mmkv_cli.core.runtime import (
                require_supported,  # the versions first, one clear line
            )

            require_supported()
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attribute)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._name))

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not yet imported"
        return f"<deferred module {self._name!r} ({state})>"


torch = Deferred("torch")
