"""The Pythons, torches and transformers mmkv supports, and one clear line for any other.

The floors are what `.ci/matrix` runs (the `floor` entry), and pyproject.toml says the same. Below
them the failure would come from deep inside transformers (it switches torch off below 2.6, and then
no model class exists), so it is named here first, from the installed versions' metadata alone:
nothing is imported to check.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from importlib import metadata

from mmkv_cli.core.errors import SetupError

PYTHON_FLOOR = (3, 11)  # transformers 5 needs 3.11; the matrix runs 3.11 to 3.14
TORCH_FLOOR = (2, 6)  # transformers 5.24 disables torch below 2.6
TRANSFORMERS_RANGE = ((5, 24), (6, 0))  # 5.24 names the LM cache argument `cache`; 6 is unknown

HOW_TO_INSTALL = "pip install 'torch>=2.6' 'transformers>=5.24,<6' (see the README's Install)"


def release(text: str) -> tuple[int, ...]:
    """'2.14.1+cpu' -> (2, 14, 1); '2.15.0.dev20261101' -> (2, 15, 0): the leading digits."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in version)


def python_problem(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> str | None:
    if version[:2] < PYTHON_FLOOR:
        return (
            f"mmkv needs Python {dotted(PYTHON_FLOOR)} or newer; this is Python {dotted(version)}"
        )
    return None


def library_problem(name: str, installed: str | None, floor, ceiling=None) -> str | None:
    """One line if `installed` (a version string, None if absent) is outside [floor, ceiling)."""
    if installed is None:
        return f"mmkv needs {name}, which is not installed: {HOW_TO_INSTALL}"
    found = release(installed)
    if found < floor:
        return (
            f"mmkv needs {name} {dotted(floor)} or newer; this environment has {name} "
            f"{installed}: {HOW_TO_INSTALL}"
        )
    if ceiling is not None and found >= ceiling:
        return (
            f"mmkv supports {name} below {dotted(ceiling)}; this environment has {name} "
            f"{installed}: {HOW_TO_INSTALL}"
        )
    return None


def installed_version(name: str) -> str | None:
    """The installed distribution's version; a module importable without metadata (a source
    build on the path) passes as its floor, since nothing says otherwise."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        if importlib.util.find_spec(name) is not None:
            return dotted(TORCH_FLOOR if name == "torch" else TRANSFORMERS_RANGE[0])
        return None


@cache
def problem() -> str | None:
    """What is outside the supported range here, in one line, or None."""
    return (
        python_problem()
        or library_problem("torch", installed_version("torch"), TORCH_FLOOR)
        or library_problem("transformers", installed_version("transformers"), *TRANSFORMERS_RANGE)
    )


def require_supported() -> None:
    """Raise SetupError (exit 9) naming what to install, before torch or transformers loads."""
    found = problem()
    if found is not None:
        raise SetupError(found)
