"""Generation apart from cache assembly: token choice (greedy or sampled), stop strings, and a text
stream that never shows a broken character."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mmkv_cli.core.errors import ModelError
from mmkv_cli.core.options import GenerationOptions
from mmkv_cli.pack import LaterVerdicts

REPLACEMENT = "\ufffd"  # what a byte-level tokenizer decodes an incomplete UTF-8 sequence to


def pick(
    logits: torch.Tensor,
    options: GenerationOptions,
    rng: torch.Generator | None,
    later: LaterVerdicts | None = None,
) -> int:
    """The next token from logits [vocab]: the argmax at temperature 0, else a sample from the
    temperature-scaled distribution cut to its top-p mass. Never from NaN or Inf: an argmax of them
    is an arbitrary token, an answer that only looks like one. later: the context's verdicts not
    yet read, read in the same transfer (a pack they refuse is named before the logits are)."""
    if later is not None:  # the host's checks first: the device runs on meanwhile
        later.check_reads()
    pending = later.pending() if later is not None else None
    verdicts = [] if pending is None else [pending]
    if options.temperature <= 0:  # the token and the checks in one transfer: one wait a token
        token, finite, *context = torch.stack(
            [logits.argmax(dim=-1), torch.isfinite(logits).all(), *verdicts]
        ).tolist()
        _settle(later, context)
        _refuse_non_finite(finite)
        return token
    finite, *context = torch.stack([torch.isfinite(logits).all(), *verdicts]).tolist()
    _settle(later, context)
    _refuse_non_finite(finite)
    probs = torch.softmax(logits.float() / options.temperature, dim=-1)
    if options.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= options.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))


def _settle(later: LaterVerdicts | None, read: list) -> None:
    if later is not None and read:
        later.settle(bool(read[0]))


def _refuse_non_finite(finite) -> None:
    if not finite:
        raise ModelError(
            "the model's next-token scores are not finite (NaN or Inf): the KV it was given or its "
            "weights are broken, so no answer is given"
        )


@dataclass
class TextStream:
    """Token ids in, text pieces out. A piece is held back while the text ends in an incomplete
    character (a byte-level token can split one) or in what may be the start of a stop string."""

    decode: Callable[[list[int]], str]
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    shown: str = ""  # text already handed out
    stopped: bool = False  # a stop string was seen: the text ends before it

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        cut = min((text.find(s) for s in self.stop if s and s in text), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith(REPLACEMENT):
            return ""
        return self._emit(text[: len(text) - self._stop_prefix(text)])

    def finish(self) -> str:
        """What is still held back once generation ends."""
        if self.stopped:
            return ""
        return self._emit(self.decode(self.ids))

    def _emit(self, text: str) -> str:
        # a tokenizer re-spelled earlier text: hand out the rest
        if not text.startswith(self.shown):
            common = 0
            while common < min(len(text), len(self.shown)) and text[common] == self.shown[common]:
                common += 1
            text = self.shown + text[common:]
        piece = text[len(self.shown) :]
        self.shown = text
        return piece

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass
class Generated:
    token_ids: list[int]
    text: str
    first_token_s: float  # seconds from the call to the first token chosen


def generate(
    first_logits: torch.Tensor,
    step: Callable[[int], torch.Tensor],
    decode: Callable[[list[int]], str],
    stop_ids: set[int],
    options: GenerationOptions,
    on_text: Callable[[str], None] | None = None,
    clock: Callable[[], float] | None = None,
    later: LaterVerdicts | None = None,
) -> Generated:
    """Decode from the logits of the question's last token. step(token) runs one token and returns
    the next logits. Ends at an end-of-turn token, a stop string or max_new_tokens. later: the
    context's NaN/Inf verdicts and checksums still being computed, read with the first token."""
    import time

    clock = clock or time.perf_counter
    start = clock()
    rng = None
    if options.temperature > 0 and options.seed is not None:
        rng = torch.Generator(device=first_logits.device).manual_seed(options.seed)
    stream = TextStream(decode, tuple(options.stop))
    logits, first = first_logits, None
    for n in range(options.max_new_tokens):
        token = pick(logits, options, rng, later if first is None else None)
        first = clock() - start if first is None else first
        if token in stop_ids:
            break
        piece = stream.push(token)
        if piece and on_text:
            on_text(piece)
        if stream.stopped or n + 1 == options.max_new_tokens:
            break
        logits = step(token)
    if later is not None:  # no token was picked: the context's checks are still read
        later.check_reads()
    unread = later.pending() if later is not None else None
    if unread is not None:  # no token was picked
        later.settle(bool(unread))
    rest = stream.finish()
    if rest and on_text:
        on_text(rest)
    return Generated(stream.ids, stream.shown, first if first is not None else clock() - start)
