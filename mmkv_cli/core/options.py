"""Options records: what the verbs take, one record per concern instead of long parameter lists."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mmkv_cli.core.errors import UsageError, flag, is_number


class Positions(str, Enum):
    """Where stored keys sit in the context at ask."""

    keep = "keep"  # their stored positions
    reindex = "reindex"  # compacted to consecutive slots, keys re-rotated by the change


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass(frozen=True)
class LoadOptions:
    """Which backbone, where. model: a preset, an HF id or a local folder (None: the default)."""

    model: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"
    layers: int | None = None  # rehearsal models: cut the depth (CPU runs at real width)


@dataclass(frozen=True)
class MethodSpec:
    """A method or preset by name with parameters set over its own: what a typed method object
    (`mmkv.methods.HERMES(...)`) and a server request's method object become. The parameters are
    checked against the method's class when the encode resolves it (methods/choice.py)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodeOptions:
    """What an encode stores, and how. kv_bits is normalised as kv_bits_value does."""

    method: str | MethodSpec = "full"  # a method or a method preset, by name or with parameters
    budget: float | None = None  # share of visual tokens kept (None: the method's default)
    budget_tokens: int | None = None  # visual tokens kept per layer, instead of a share
    fps: float | None = None  # None: the model's
    max_frames: int | None = None  # None: the model's
    guidance_prompt: str | None = None  # for methods that score by a prompt (None: by media kind)
    force: bool = False  # replace an existing output
    # bits per stored visual K/V value: 16 (as computed), 8, 4, 2 or 1.5 (VidKV's mixed bits);
    # None: the method's own (16 but for methods that quantize as part of them: StreamingTOM 4)
    kv_bits: float | None = None
    # quantization group: tokens per key group, channels per value group (QuantSpec's default, the
    # smallest packs at real width in bench/quant.py)
    kv_group: int = 128
    checkpoint_every: int = 0  # save the streaming state every N chunks beside the output (0: no)
    resume: bool = False  # continue from the checkpoint an interrupted encode left

    reduce: str | None = None  # a token reducer before the prefill (None: the method's; "none")
    # the reducer's parameters over its defaults (or over a preset's, for the reducer it names)
    reduce_params: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kv_bits is not None:
            object.__setattr__(self, "kv_bits", kv_bits_value(self.kv_bits))

    def bits_for(self, method) -> int | float:
        """The bits this encode stores at: the command line's, else the method's (a Method)."""
        return given_or_own_bits(self.kv_bits, method)


# bits a pack's visual K/V may be stored at: 16 as computed; 8, 4, 2 after KIVI; 1.5 after VidKV
KV_BITS = (16, 8, 4, 2, 1.5)


def given_or_own_bits(bits, method) -> int | float:
    """The bits asked for, else the method's own (a Method: 16, or 4 for StreamingTOM)."""
    return kv_bits_value(bits if bits is not None else method.kv_bits)


def kv_bits_value(value) -> int | float:
    """A --kv-bits value as the rest of mmkv takes it: a whole number as an int (8.0 -> 8), 1.5 as
    is; one that is not offered is refused in one line."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if number not in KV_BITS or isinstance(value, bool):
        shown = f"{number:g}" if math.isfinite(number) else repr(value)
        raise UsageError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, not {shown}")
    return int(number) if number.is_integer() else number


# what a question and a sampling seed may be, checked by every verb that answers (api.PackSession)
MAX_QUESTION_CHARS = 20_000  # a question is text for one prompt, not a document
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch generator takes


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling mass (with temperature > 0)
    seed: int | None = None  # sampling seed (None: nondeterministic)
    stop: tuple[str, ...] = ()  # stop strings: the answer ends before the first one


def check_generation(options: GenerationOptions) -> None:
    """Sampling settings every verb that answers takes (ask, chat, serve, live), checked before a
    model loads: one clear line for each, never a NaN that samples garbage."""
    import math

    o = options
    if not (is_number(o.max_new_tokens) and int(o.max_new_tokens) == o.max_new_tokens >= 1):
        raise UsageError(f"{flag('max_new_tokens')} must be a whole number, at least 1")
    if not (is_number(o.temperature) and math.isfinite(o.temperature) and o.temperature >= 0):
        raise UsageError(f"{flag('temperature')} must be a number >= 0, not {o.temperature!r}")
    if not (is_number(o.top_p) and math.isfinite(o.top_p) and 0 < o.top_p <= 1):
        raise UsageError(f"{flag('top_p')} must be in (0, 1], not {o.top_p!r}")
    seed = o.seed
    if seed is not None and not (
        isinstance(seed, int)
        and not isinstance(seed, bool)
        and SEED_RANGE[0] <= seed <= SEED_RANGE[1]
    ):
        raise UsageError(f"{flag('seed')} must fit in 64 bits ({SEED_RANGE[0]} to {SEED_RANGE[1]})")


@dataclass(frozen=True)
class AskOptions:
    at: float | None = None  # the question's moment (seconds; image or page index for stills)
    positions: Positions | None = None  # None: the method's
    prune: str | None = None  # a method that prunes the context's visual KV by the question
    prune_budget: float | None = None  # with prune: share of visual KV kept (None: its default)
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    keep_logits: bool = False  # keep the first answer token's logits (tests, comparisons)
    # list every block of the context with its span, where no retrieval scored them (`--explain`)
    explain: bool = False
    # earlier (question, answer) turns, oldest first: the question follows them, after the context
    history: tuple[tuple[str, str], ...] = ()


def check_ask(options: AskOptions) -> None:
    """An ask's own settings and its sampling, checked before a model loads."""
    import math

    at, share = options.at, options.prune_budget
    if at is not None and not (is_number(at) and math.isfinite(at) and at >= 0):
        raise UsageError(
            f"{flag('at')} must be a finite number of seconds (or an index), 0 or more"
        )
    budget = flag("prune_budget")
    if share is not None and not options.prune:
        raise UsageError(f"{budget} at ask only applies with {flag('prune')} METHOD")
    if share is not None and not (is_number(share) and 0 < share <= 1):
        raise UsageError(f"{budget} must be in (0, 1], not {share!r}")
    check_generation(options.generation)
