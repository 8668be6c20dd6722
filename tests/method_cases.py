"""How the contract tests run each method: one row per method whose defaults do not fit (kvpress's
`default_presses`, as a table). A method with no row is encoded at half its visual tokens and must
keep about that many; one that keeps everything needs no budget."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Case:
    budget: dict = field(default_factory=lambda: {"budget": 0.5})  # the encode's budget options
    # several views of one stream (MuKV's patches, frames and segments): what a layer keeps may
    # add up to more than the budget, so only "fewer than everything" is asked of it
    views_overlap: bool = False
    # one summary entry a temporal step beside the budget (StreamMem's frame prototypes)
    per_step_extra: bool = False


CASES = {
    # a token budget under the stream, so it compresses while streaming
    "hermes": Case({"budget_tokens": 24}),
    "mukv": Case(views_overlap=True),
    "streammem": Case(per_step_extra=True),
    # one background entry a frame beside the foreground's budget
    "causalmem": Case(per_step_extra=True),
}


def case_for(method: str) -> Case:
    """A method's case, or a preset's: its method's."""
    from mmkv_cli.methods.choice import resolve_method

    if not resolve_method(method).method.takes_budget:
        return Case({})
    return CASES.get(method, Case())
