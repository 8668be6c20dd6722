"""One exception family for every user-facing failure; the CLI turns each into one line + exit
code."""

import contextlib
import contextvars
from collections.abc import Iterator


class MmkvError(Exception):
    """Base class: `str(err)` is the one line the user sees."""

    exit_code = 1


class UsageError(MmkvError):
    """A bad argument value (budget out of range, unknown method, ...)."""

    exit_code = 2


class MediaError(MmkvError):
    """The input media is missing, unreadable or empty."""

    exit_code = 3


class PackError(MmkvError):
    """A .kvpack is missing, truncated, corrupted or from another model."""

    exit_code = 4


def unreadable(path, err: OSError) -> PackError:
    """The one line a pack whose bytes cannot be read is refused with (a failing disk, a lost
    network mount, a path to something that is no file): never a traceback."""
    return PackError(f"cannot read {path}: {err.strerror or err}")


class ModelError(MmkvError):
    """A backbone cannot be found or loaded."""

    exit_code = 5


class OutputExistsError(MmkvError):
    """Refusing to overwrite an existing file without --force."""

    exit_code = 6


# who is calling: the CLI (options are --flags) or Python (keywords); `mmkv`'s functions set
# "python" for their call, so an error names what that caller types
CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="cli")


def flag(option: str, value: str | None = None) -> str:
    """How the caller at hand spells an option: `--budget-tokens` on the command line,
    `budget_tokens` in Python (`value`: the keyword's value, force=True) and in a JSON body
    ("budget_tokens": 24)."""
    caller = CALLER.get()
    if caller == "python":
        return option if value is None else f"{option}={value}"
    if caller == "http":
        return option if value is None else f'"{option}": {value}'
    return "--" + option.replace("_", "-")


def is_number(value: object) -> bool:
    """An int or float (a bool is neither here): what a numeric option may be given as."""
    return isinstance(value, int | float) and not isinstance(value, bool)


@contextlib.contextmanager
def called_from(caller: str) -> Iterator[None]:
    """Errors raised inside name options as `caller` spells them ("python" or "http")."""
    token = CALLER.set(caller)
    try:
        yield
    finally:
        CALLER.reset(token)


@contextlib.contextmanager
def called_from_python() -> Iterator[None]:
    """Errors raised inside name options as Python keywords (a decorator too)."""
    with called_from("python"):
        yield


def output_exists(what: object) -> OutputExistsError:
    """`what` is there already, and how this caller replaces it."""
    return OutputExistsError(f"{what} already exists; pass {flag('force', 'True')} to replace it")


class StorageError(MmkvError):
    """Object storage cannot be reached, refuses access, or its driver is not installed."""

    exit_code = 7


class AddressError(MmkvError):
    """`serve` cannot listen where it was asked: the port is taken, or the address is not this
    machine's."""

    exit_code = 8


class SetupError(MmkvError):
    """The interpreter, torch or transformers is outside the range mmkv supports."""

    exit_code = 9
