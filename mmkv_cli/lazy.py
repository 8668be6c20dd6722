"""torch, imported on its first use rather than at import time.

`mmkv --help`, `mmkv methods` and `inspect` of a local pack touch method and pack modules but never
a tensor op, and importing torch costs seconds. The standard library's LazyLoader defers
executing the module until an attribute is read, so `torch.zeros(...)` loads it then. Modules that
may be imported on those fast paths take `torch` from here; everything else imports it as usual.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType


def lazy_import(name: str) -> ModuleType:
    """`name` as a module object that runs its import on first attribute access."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(name)
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    loader.exec_module(module)
    return module


torch = lazy_import("torch")
