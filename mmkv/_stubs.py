"""methods.pyi, written from the method registry so type checkers and editors see every method
class with its parameters: `python -m mmkv._stubs` rewrites it; a test fails while it differs."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from mmkv.methods import CLASSES, MethodConfig

STUB = Path(__file__).with_name("methods.pyi")


def annotation(tp: Any, imports: set[str]) -> str:
    """`tp` as Python writes it in a stub; a parameter class nested in another is given as itself
    or as a mapping of its fields."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(annotation(arg, imports) for arg in typing.get_args(tp))
    if origin is Literal:
        return "Literal[" + ", ".join(repr(arg) for arg in typing.get_args(tp)) + "]"
    if origin is tuple:
        return "tuple[" + ", ".join(annotation(arg, imports) for arg in typing.get_args(tp)) + "]"
    if tp is type(None):
        return "None"
    if tp is Ellipsis:  # tuple[str, ...]
        return "..."
    if dataclasses.is_dataclass(tp):
        imports.add(f"from {tp.__module__} import {tp.__name__}")
        return f"{tp.__name__} | Mapping[str, Any]"
    return tp.__name__


def _class_stub(cls: type[MethodConfig], imports: set[str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    own = [f for f in dataclasses.fields(cls) if f.name not in MethodConfig.__dataclass_fields__]
    lines = [f"class {cls.__name__}(MethodConfig):", f'    """{cls.__doc__.splitlines()[0]}"""']
    for f in own:
        lines.append(f"    {f.name}: {annotation(hints[f.name], imports)}")
    lines.append("    def __init__(")
    lines.append("        self,")
    lines.append("        *,")
    lines.append("        budget: float | None = ...,")
    lines.append("        budget_tokens: int | None = ...,")
    lines.append("        reduce: str | None = ...,")
    lines.append("        reduce_params: Mapping[str, Any] | None = ...,")
    for f in own:
        lines.append(f"        {f.name}: {annotation(hints[f.name], imports)} = ...,")
    lines.append("    ) -> None: ...")
    return lines


def render() -> str:
    """The stub's text for the registry as it is."""
    imports: set[str] = set()
    body: list[str] = []
    for cls in CLASSES.values():
        body += ["", "", *_class_stub(cls, imports)]
    names = ", ".join(f'"{cls.__name__}"' for cls in CLASSES.values())
    head = [
        "# Written by `python -m mmkv._stubs` from the method registry: do not edit.",
        "from collections.abc import Mapping",
        "from typing import Any, ClassVar, Literal",
        "",
        "from mmkv_cli.core.options import EncodeOptions, MethodSpec",
        *sorted(imports),
        "",
        f'__all__ = ["MethodConfig", "get", {names}]',
        "",
        "class MethodConfig:",
        '    """A method with its parameters, each checked when it is built."""',
        "    method: ClassVar[str]",
        "    budget: float | None",
        "    budget_tokens: int | None",
        "    reduce: str | None",
        "    reduce_params: Mapping[str, Any] | None",
        "    def spec(self) -> MethodSpec: ...",
        "    def encode_options(self, **options: Any) -> EncodeOptions: ...",
        "",
        "def get(name: str, **changes: Any) -> MethodConfig: ...",
        "",
        "CLASSES: dict[str, type[MethodConfig]]",
    ]
    return "\n".join(head + body) + "\n"


if __name__ == "__main__":
    STUB.write_text(render())
    sys.stdout.write(f"wrote {STUB}\n")
