"""A method as a user names it: a method in code, or a preset over one (presets/methods/*.yaml),
with its typed parameters and budget, checked before any work."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from mmkv_cli.core.errors import UsageError, flag, is_number
from mmkv_cli.core.options import EncodeOptions, MethodSpec
from mmkv_cli.core.spec import as_plain, describe, override
from mmkv_cli.methods import METHODS, Budget, Method, pruning_methods
from mmkv_cli.methods.base import GuidedParams
from mmkv_cli.presets import find_preset, preset_names, read_preset
from mmkv_cli.reduce.choice import ReducerChoice, resolve_reducer

METHOD_KEYS = (
    "extends",
    "description",
    "budget",
    "budget_tokens",
    "params",
    "reduce",
    "reduce_params",
)


@dataclass(frozen=True)
class MethodChoice:
    """A method as a user names it: one in code, or a preset over one, with its typed parameters."""

    name: str
    method: Method
    params: Any  # an instance of method.params
    budget: Budget | None  # None: the method keeps every token
    description: str
    reduce: ReducerChoice | None = None  # the token reducer before the prefill (None: every token)

    def with_budget(self, share: float | None = None, tokens: int | None = None) -> MethodChoice:
        """The command line's budget: a share (--budget) or a token count (--budget-tokens)."""
        if share is None and tokens is None:
            return self
        given = flag("budget" if share is not None else "budget_tokens")
        if self.method.adaptive:
            raise UsageError(f"method '{self.name}' sizes its memory by its own parameters: "
                             f"{given} does not apply (its parameters set them)")  # fmt: skip
        if self.method.keeps_all:
            raise UsageError(f"method '{self.name}' keeps every token: {given} does not apply")
        if share is not None and tokens is not None:
            raise UsageError(
                f"give {flag('budget')} (a share) or {flag('budget_tokens')}, not both"
            )
        if tokens is not None and not (isinstance(tokens, int) and not isinstance(tokens, bool)
                                       and tokens >= 1):  # fmt: skip
            raise UsageError(f"{flag('budget_tokens')} must be a whole number, at least 1, got "
                             f"{tokens!r}")  # fmt: skip
        budget = Budget(tokens=tokens) if tokens is not None else Budget(share=check_budget(share))
        return replace(self, budget=budget)

    def with_reduce(self, name: str | None, params: Mapping | None = None) -> MethodChoice:
        """The command line's `--reduce NAME` (None: as the method or preset says; 'none': no
        reducer). Naming the reducer the preset already has keeps the preset's parameters.
        params: the reducer's parameters (Python's reduce_params), over the preset's for its own
        reducer, else over the reducer's defaults."""
        if params is not None:
            named = name if name is not None else (self.reduce.name if self.reduce else None)
            return replace(self, reduce=resolve_reducer(named, params, "reduce", self.reduce))
        if name is None or (self.reduce is not None and name == self.reduce.name):
            return self
        return replace(self, reduce=resolve_reducer(name))

    def with_guidance(self, prompt: str | None) -> MethodChoice:
        """Refuse `--guidance-prompt` for a method that scores by no prompt."""
        if prompt is not None:
            if not isinstance(self.params, GuidedParams):
                raise UsageError(f"method '{self.name}' uses no guidance prompt")
            if not prompt.strip():
                raise UsageError("--guidance-prompt is empty")
        return self


def choice_for(options: EncodeOptions) -> MethodChoice:
    """The method an encode's options name, with their budget, guidance prompt and reducer, each
    checked before any work."""
    choice = resolve_spec(options.method).with_budget(options.budget, options.budget_tokens)
    guided = choice.with_guidance(options.guidance_prompt)
    return guided.with_reduce(options.reduce, options.reduce_params)


def _unbudgeted(choice: MethodChoice) -> str:
    """What a method without a budget keeps: everything, its window of newest frames, or what
    its own thresholds let stay."""
    if choice.method.adaptive:
        return "own sizes"
    window = choice.method.window
    return f"{window(choice.params)} frames" if window else "keeps all"


def method_listing() -> list[dict]:
    """Every method and preset with its paper, budget and parameters at its values, as `mmkv
    methods --json` lists them."""
    rows = []
    for name in method_names():
        choice = resolve_method(name)
        method, budget = choice.method, choice.budget
        values = as_plain(choice.params)
        rows.append(
            {
                "name": name,
                "implements": method.name,
                "label": method.label,
                "description": choice.description,
                "paper": {
                    "title": method.paper.title,
                    "year": method.paper.year,
                    "url": method.paper.url,
                },
                "budget": budget.label() if budget else _unbudgeted(choice),
                "budget_share": budget.share if budget else None,
                "budget_tokens": budget.tokens if budget else None,
                "abilities": method.abilities(),
                "params": [{**p, "value": values[p["name"]]} for p in describe(method.params)],
                "reduce": choice.reduce.record() if choice.reduce else None,
                "kv_bits": method.kv_bits,
                "start_here": method.start_here if name == method.name else None,
            }
        )
    return rows


def resolve_spec(method: str | MethodSpec) -> MethodChoice:
    """A method by name, or by name with parameters set over its own (each checked)."""
    if isinstance(method, str):
        return resolve_method(method)
    choice = resolve_method(method.name)
    params = override(choice.params, dict(method.params), f"method {method.name}")
    return replace(choice, params=params)


def check_budget(budget: float) -> float:
    if not is_number(budget):
        raise UsageError(f"budget must be a number in (0, 1], got {budget!r}")
    if not (0.0 < budget <= 1.0):
        raise UsageError(f"budget must be in (0, 1], got {budget:g}")
    return float(budget)


def check_pruning(method: str) -> MethodChoice:
    """`method` (or a preset over it) if it prunes a context by the question at ask, else one
    line naming those that do."""
    choice = resolve_method(method)
    if choice.method.prune_at_ask is None:
        able = ", ".join(pruning_methods())
        raise UsageError(f"method '{method}' does not prune at ask ({able} do)")
    return choice


def method_names() -> list[str]:
    return sorted(set(METHODS) | preset_names("methods"))


def resolve_method(name: str, _seen: tuple[str, ...] = ()) -> MethodChoice:
    """The method or preset called `name`, its parameters checked against their types and ranges."""
    path = find_preset("methods", name)
    if path is None:
        if name in METHODS:
            return _in_code(name)
        near = difflib.get_close_matches(name, method_names(), n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise UsageError(f"unknown method '{name}': {hint}(known: {', '.join(method_names())})")
    if name in _seen:
        raise UsageError(f"preset {path} extends itself (through {' -> '.join(_seen)})")
    data = read_preset(path)
    for key in data:
        if key not in METHOD_KEYS:
            raise UsageError(f"{path}: unknown key '{key}' (known: {', '.join(METHOD_KEYS)})")
    base_name = data.get("extends", name if name in METHODS else None)
    if not isinstance(base_name, str):
        raise UsageError(f"{path}: 'extends' must name a method ({', '.join(METHODS)})")
    if base_name == name and name in METHODS:  # a user file named after a method in code
        base = _in_code(name)
    else:
        base = resolve_method(base_name, (*_seen, name))
    params = override(base.params, data.get("params") or {}, f"{path}: params")
    description = data.get("description", base.description)
    if not isinstance(description, str):
        raise UsageError(f"{path}: description must be text")
    reduce = base.reduce
    if "reduce" in data or "reduce_params" in data:
        named = data.get("reduce", base.reduce.name if base.reduce else None)
        reduce = resolve_reducer(named, data.get("reduce_params"), f"{path}: reduce", base.reduce)
    choice = MethodChoice(name, base.method, params, base.budget, description, reduce)
    for key, keyword in (("budget", "share"), ("budget_tokens", "tokens")):
        if key in data:
            value = data[key]
            wanted = float if key == "budget" else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{path}: {key}: expected a number, got {value!r}")
            if wanted is int and not isinstance(value, int):
                raise UsageError(f"{path}: {key}: expected a whole number, got {value!r}")
            try:
                choice = choice.with_budget(**{keyword: wanted(value)})
            except UsageError as err:
                raise UsageError(f"{path}: {key}: {err}") from None
    return choice


def _in_code(name: str) -> MethodChoice:
    """A method in code as it comes: its defaults, its budget, its own reducer if it has one."""
    method = METHODS[name]
    reduce = resolve_reducer(method.reducer, where=f"method {name}")
    return MethodChoice(name, method, method.params(), method.budget, method.description, reduce)


def check_live(choice: MethodChoice) -> MethodChoice:
    """Refuse, before any work, what cannot follow a stream of unknown length."""
    method, budget = choice.method, choice.budget
    if method.blockwise is not None:
        if budget is not None and budget.tokens is not None:
            raise UsageError(
                f"'{choice.name}' keeps a share of each block: a token count needs the stream's "
                f"length, which a live stream does not have (give a share: {flag('budget')})"
            )
        return choice
    if method.takes_budget and (budget is None or budget.tokens is None):
        share = f"{budget.share:g}" if budget is not None and budget.share is not None else "all"
        raise UsageError(
            f"a live stream has no length to take a share of: give '{choice.name}' its memory as "
            f"a token count, {flag('budget_tokens')} (its budget is a share, {share})"
        )
    return choice
