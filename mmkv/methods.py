"""Every compression method as a class you build and pass to `mmkv.encode`, `mmkv.live` or a
server's stream request:

    from mmkv import methods

    hermes = methods.HERMES(budget_tokens=4096, deep_share=0.4)
    mmkv.encode("clip.mp4", "clip.kvpack", model="demo", method=hermes)

The classes are made from the method registry (`mmkv_cli.methods.METHODS`): one per method, named
as its paper writes it, with a keyword for each of its parameters at the authors' default, and
`budget`, `budget_tokens` and `reduce`. Building one checks every value as a preset's would be
checked, so a wrong one fails here, before any media or model is touched. `get(name)` builds the
class of a method or preset by name with its values. methods.pyi spells the classes out for type
checkers; a test keeps it equal to what the registry makes.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from mmkv_cli.core.errors import called_from_python
from mmkv_cli.core.options import EncodeOptions, MethodSpec
from mmkv_cli.core.spec import as_plain, knob
from mmkv_cli.methods import METHODS, Method
from mmkv_cli.methods.choice import choice_for, resolve_method

__all__ = ["MethodConfig", "get", *sorted(method.label for method in METHODS.values())]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """A method with its parameters, each checked when it is built. Subclasses (one per method)
    add the method's own parameters.

    Attributes:
        budget: the share of visual tokens kept, in (0, 1] (None: the method's default).
        budget_tokens: visual tokens kept per layer, instead of a share.
        reduce: a token reducer before the prefill (None: the method's own; 'none': none).
        reduce_params: the reducer's parameters over its defaults (a preset's: over the preset's).
    """

    method: ClassVar[str]  # the method's name in the registry
    budget: float | None = knob(None, "share of visual tokens kept, in (0, 1] (None: its default)")
    budget_tokens: int | None = knob(None, "visual tokens kept per layer, instead of a share")
    reduce: str | None = knob(None, "a token reducer before the prefill (None: its own; 'none')")
    reduce_params: Mapping[str, Any] | None = knob(None, "the reducer's parameters over its own")

    def __post_init__(self) -> None:
        with called_from_python():
            choice = choice_for(self.encode_options())  # every value checked, as a preset's is
        for name, value in vars(choice.params).items():  # mappings given become typed values
            object.__setattr__(self, name, value)
        if self.reduce_params is not None:  # a copy: the caller's dict may change after
            object.__setattr__(self, "reduce_params", dict(self.reduce_params))

    def spec(self) -> MethodSpec:
        """The method by name with these parameters (what an options record carries)."""
        names = [f.name for f in dataclasses.fields(METHODS[self.method].params)]
        return MethodSpec(self.method, {name: as_plain(getattr(self, name)) for name in names})

    def encode_options(self, **options: Any) -> EncodeOptions:
        """An encode's options with this method, its budget and reducer (`options`: the rest)."""
        return EncodeOptions(
            method=self.spec(),
            budget=self.budget,
            budget_tokens=self.budget_tokens,
            reduce=self.reduce,
            reduce_params=self.reduce_params,
            **options,
        )


def _method_class(method: Method) -> type[MethodConfig]:
    """The class of one method in the registry: its parameters as keyword-only fields."""
    defaults = method.params()
    hints = typing.get_type_hints(method.params)
    fields, lines = [], []
    for f in dataclasses.fields(method.params):
        value = getattr(defaults, f.name)
        fields.append(
            (f.name, hints[f.name], dataclasses.field(default=value, metadata=f.metadata))
        )
        lines.append(f"    {f.name}: {f.metadata.get('doc', '')} (default {as_plain(value)!r})")
    budget = method.budget.label() if method.budget else "keeps every token"
    doc = (
        f"{method.label}: {method.description}.\n\n{method.paper.title} ({method.paper.year}). "
        f"Default budget: {budget}.\n\nArgs:\n" + "\n".join(lines)
    )
    namespace = {"method": method.name, "__doc__": doc, "__module__": __name__}
    return dataclasses.make_dataclass(
        method.label,
        fields,
        bases=(MethodConfig,),
        namespace=namespace,
        frozen=True,
        kw_only=True,
    )


CLASSES: dict[str, type[MethodConfig]] = {
    name: _method_class(method) for name, method in METHODS.items()
}
globals().update({cls.__name__: cls for cls in CLASSES.values()})


@called_from_python()
def get(name: str, **changes: Any) -> MethodConfig:
    """The method or preset called `name` as its class, at its values (a preset's parameters,
    budget and reducer), with `changes` set over them."""
    choice = resolve_method(name)
    values: dict[str, Any] = dict(vars(choice.params))
    if choice.budget is not None and choice.budget != choice.method.budget:
        values.update(budget=choice.budget.share, budget_tokens=choice.budget.tokens)
    own = choice.method.reducer
    if (choice.reduce.name if choice.reduce else None) != own:
        values["reduce"] = choice.reduce.name if choice.reduce else "none"
    if choice.reduce is not None and choice.reduce.params != choice.reduce.reducer.params():
        values["reduce_params"] = as_plain(choice.reduce.params)
    return CLASSES[choice.method.name](**{**values, **changes})
