"""Functions of the C library that Python's os module lacks, looked up once, on first use (so
`import mmkv` stays cheap): None where this system's C library has none of the names."""

from __future__ import annotations

import ctypes

_found: dict[tuple[str, ...], object] = {}


def function(names: tuple[str, ...], argtypes: tuple, restype):
    """The first of `names` the C library has, typed by `argtypes` and `restype` (errno kept for
    ctypes.get_errno), or None."""
    if names not in _found:
        try:
            library = ctypes.CDLL(None, use_errno=True)
        except OSError:  # no C library to open by its own name (not a POSIX system)
            library = None
        found = next((getattr(library, n) for n in names if hasattr(library, n)), None)
        if found is not None:
            found.argtypes, found.restype = argtypes, restype
        _found[names] = found
    return _found[names]
