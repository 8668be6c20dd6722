"""The seams between the encoder, the ask path and the methods, declared as protocols and records.

A method is a `Method`: its typed parameter class, its paper, its default budget, and the policies
it provides. A memory policy decides at encode (question unknown) which KV enters the pack: a
`StreamingMemory` sees one running cache as the media streams through it; a `BlockwiseMemory` has
its blocks prefilled independently after the init prompt (MuKV). A `ContextPolicy` decides at ask
(question known) which stored blocks enter the context. An `AskPruner` cuts the context's visual KV
by the question's own attention. The encoder and the ask path reach a method only through these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mmkv_cli.core.spec import Paper, knob

if TYPE_CHECKING:
    import torch

    from mmkv_cli.kernels.recorder import Recorder
    from mmkv_cli.methods.running_cache import StreamState
    from mmkv_cli.pack import BlockTable, Span

# At encode no question exists yet; methods that score by a prompt's attention use one of these,
# fitted to what the media is (`encode --guidance-prompt` replaces it).
GUIDANCE = {
    "video": "What happens in this video? Describe the people, objects, text and actions, "
    "in order.",
    "images": "What do these images show? Describe the people, objects, text and scenes in each.",
    "pdf": "What do these pages say? Summarise their text, tables and figures, page by page.",
}


@dataclass(frozen=True)
class Budget:
    """How much visual KV a compressing method keeps per layer: a share of the stream, or a fixed
    count."""

    share: float | None = None  # fraction of the visual tokens, in (0, 1]
    tokens: int | None = None  # visual tokens per layer (replaces the share when set)

    def tokens_of(self, total: int) -> int:
        """Visual tokens per layer for a stream of `total` (at least one). A fixed count may exceed
        a short stream: then nothing needs evicting."""
        if self.tokens is not None:
            return max(1, self.tokens)
        return max(1, min(total, math.floor((self.share or 1.0) * total)))

    def share_of(self, total: int) -> float:
        """The budget as a fraction of a stream of `total` tokens."""
        if self.tokens is not None:
            return min(1.0, self.tokens / max(1, total))
        return self.share if self.share is not None else 1.0

    def label(self) -> str:
        return f"{self.tokens} tokens" if self.tokens is not None else f"{self.share:g}"


@dataclass(frozen=True)
class EncodeContext:
    """What a memory policy is told before any frame: the media kind and the prompt to score
    with."""

    media_kind: str = "video"
    guidance_prompt: str | None = None  # `encode --guidance-prompt`: replaces any preset's
    # a live stream's (question, answer) turns so far, oldest first: the follow adds each one it
    # answers, for a method whose memory is steered by the last (HERMES' previous_turn)
    turns: list[tuple[str, str]] = field(default_factory=list, compare=False)

    def guidance(self, preset: str | None = None) -> str:
        """The prompt to score with: the command line's, else the preset's, else the media
        kind's."""
        return self.guidance_prompt or preset or GUIDANCE.get(self.media_kind, GUIDANCE["video"])


# --- parameters shared by many methods ---


@dataclass(frozen=True)
class StreamParams:
    chunk_frames: int = knob(16, "frames prefilled per forward while streaming the media in", low=1)


@dataclass(frozen=True)
class GuidedParams(StreamParams):
    guidance_prompt: str | None = knob(
        None,
        "the prompt whose attention scores tokens at encode (null: one fitting the media kind)",
    )


def score_every_knob() -> int:
    """The field of the methods that sum every prefill row's attention (H2O, MEDA)."""
    return knob(
        1,
        "sum the attention of every Nth query row of a chunk, times N (1: every row, the paper; "
        "N > 1: an estimate that brings encode time near a plain prefill's)",
        low=1,
    )


def selection_knob() -> str:
    """The field of the methods whose code keeps tokens per KV head (H2O, MEDA, SnapKV,
    PyramidKV)."""
    return knob(
        "per_head",
        "per_head: each KV head keeps its own tokens by its own attention (the authors' code); "
        "per_layer: one set a layer, by the heads' mean attention",
    )


# --- memory policies ---


class StreamingMemory(Protocol):
    """Sees the running encode cache after every chunk and may evict from it; cuts what stays into
    blocks."""

    def recorder(self, state: StreamState) -> Recorder | None:
        """What to record while each chunk is prefilled (None: nothing)."""

    def observe(self, state: StreamState, recorder: Recorder) -> None:
        """After each chunk, with what `recorder()` asked for."""

    def after_chunk(self, state: StreamState) -> None:
        """After every streamed chunk; may evict."""

    def finish(self, state: StreamState) -> None:
        """Once after the last chunk, before the suffix is prefilled."""

    def make_blocks(self, state: StreamState, step_times: list[tuple[float, float]]) -> list[Span]:
        """What the cache holds at the end, as the pack's blocks in time order."""

    # it chooses by what the language model took in (FluxMem, CausalMem): each chunk's grid tokens
    # as embedded are on the state (StreamState.chunk_grid) when after_chunk runs
    reads_embeddings: bool

    # its blocks carry their tokens as the language model took them in (Span.embeddings), for a
    # question's late interaction at ask (SAVEMem's retrieval); the pack stores them (v13)
    keeps_embeddings: bool

    # every token it holds stays as prefilled, one block per temporal step (made by step_block):
    # its blocks can be made, and written, as each chunk goes in
    seals_as_prefilled: bool

    def step_block(self, number, step, time, keys, values, positions, rope) -> Span:
        """Temporal step `step`'s block, the pack's `number`th, from each layer's K, V [H_kv, n, D]
        and positions [P, n] of it; its retrieval key made with `rope` (None: none)."""

    def representative(self, keys, positions, rope) -> torch.Tensor | None:
        """A block's retrieval key from each layer's K [H_kv, n, D] and positions [P, n] of it, on
        the keys' device (a caller may make it before the block, where the keys are)."""

    def saved(self) -> dict[str, torch.Tensor]:
        """The policy's own state between chunks as named tensors, for a resumable encode's
        checkpoint (the running cache is saved apart)."""

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Take back the state `saved()` gave."""


@dataclass
class BlockPlan:
    """One block of a blockwise method: which tokens of the visual stream it holds."""

    granularity: str
    tokens: torch.Tensor  # indices into the visual stream (or a chunk of it), ascending
    steps: tuple[int, int]  # temporal steps [start, stop) it covers
    keep: int | None = None  # tokens it keeps, fixed while planning (0: not stored, not prefilled)


class BlockwiseMemory(Protocol):
    """Blocks prefilled on their own after the init prompt; the encoder batches blocks of one
    size."""

    batch_tokens: int  # tokens in one prefill batch's cache: rows x (init prompt + block)
    chunk_frames: int
    retrieval_layers: str  # last: a block's retrieval key from its last layer; each: one per layer
    # pre_rope: a retrieval key is its kept keys' mean rotated back to before RoPE; post_rope: the
    # mean of the kept keys as the block was prefilled after the init prompt (MuKV's code)
    retrieval_space: str

    def begin(self, total: int) -> None:
        """Before any block: the stream will give `total` visual tokens."""

    def segment_steps(self, frames_per_step: int) -> int:
        """Temporal steps a chunk must hold whole (a chunk never cuts a block)."""

    def plan(
        self,
        step_starts: list[int],
        step_lengths: list[int],
        grid_offsets: list[int],
        grid: tuple[int, int],
        frames_per_step: int,
    ) -> list[BlockPlan]:
        """The blocks over these steps, tokens indexed from the first step's first token."""

    def choose(
        self, plan: BlockPlan, attention: torch.Tensor, last_keys: torch.Tensor
    ) -> torch.Tensor:
        """Local indices block `plan` keeps. attention [N] column sums; last_keys [H_kv, N, D]."""


# --- the ask side ---


@dataclass
class Selection:
    names: list[str]  # blocks entering the context, in context order
    explain: list[dict]  # per retrieved block: why it was chosen (empty when nothing was scored)
    ends_at: str | None = None  # with a question asked `at` a moment: the last block shown by then
    # per-layer retrieval: for every layer the blocks it takes (a subset of names, in that order)
    per_layer: list[list[str]] | None = None
    # retrieval left to the answering forward, layer by layer (names empty until it has run)
    in_forward: LayerRetrieval | None = None


class LayerRetrieval(Protocol):
    """Blocks chosen inside the answering forward: each layer asks with the question's own vector
    there, so what layers below retrieved shapes it (ReKV's code)."""

    query: str  # the question vector: query_mean | last_key

    def check_layers(self, layers: int) -> None:
        """Refuse, in one line, a pack that cannot be retrieved from at each of `layers`."""

    def pick(self, layer: int, vector: torch.Tensor) -> list[str]:
        """The blocks `layer` attends, in context order, for its question vector [dim] (before
        RoPE)."""

    def selection(self) -> Selection:
        """Every layer's picks as one Selection, once the forward has run."""


# query mode -> [layers, dim]: the question's retrieval vector at every layer, before RoPE
QuestionVector = Callable[[str], "torch.Tensor"]


class TakenIn(Protocol):
    """A pack's tokens and the question's as the language model takes them in (its input
    embeddings), for a policy that chooses by late interaction (SAVEMem's retrieval). Lazy: a
    policy that asks for neither costs nothing."""

    frames_per_step: int  # frames one temporal step of the pack holds

    def blocks(self) -> torch.Tensor | None:
        """[tokens, dim] unit rows, one a token each block's first layer holds, in table order
        (a zero row: not a visual token), as stored on the host (None: the pack keeps none)."""

    def question(self) -> torch.Tensor:
        """[q, dim] unit rows of the prompt's text tokens: the prefix's, the suffix's and the
        question's, where the model is."""


class ContextPolicy(Protocol):
    position_mode: str  # keep | reindex

    def select(
        self,
        blocks: BlockTable,
        reps: Callable[[], torch.Tensor],
        question_vector: QuestionVector,
        at: float | None = None,
        taken_in: TakenIn | None = None,
    ) -> Selection:
        """Blocks for the context. reps() loads the representatives, question_vector(mode) runs
        the question and taken_in holds both as embedded; all lazy, so a policy that needs none
        costs nothing."""


# rows: per layer the question's attention [q, k]; visual / question: per layer the key columns of
# the context's visual tokens and of the question -> per layer the local visual indices to keep.
AskPruner = Callable[
    [list["torch.Tensor"], list[slice], list[slice], float, Any], list["torch.Tensor"]
]


@dataclass(frozen=True)
class Method:
    """A compression method as the registry knows it."""

    name: str
    label: str  # its name as the papers write it, and its class in Python (mmkv.methods.HERMES)
    description: str
    paper: Paper
    params: type  # the typed parameter class (defaults in code, presets override)
    budget: Budget | None  # the default budget; None: every token is kept (--budget is refused)
    streaming: Callable[[Any, Budget, EncodeContext], StreamingMemory] | None = None
    blockwise: Callable[[Any, Budget], BlockwiseMemory] | None = None
    context: Callable[[Any], ContextPolicy] | None = None  # None: every stored block (WholeContext)
    prune_at_ask: AskPruner | None = None  # offered to `ask --prune`
    reducer: str | None = None  # the token reducer it runs before the prefill (StreamingTOM's CTR)
    kv_bits: float = 16  # bits its pack stores K/V at unless `--kv-bits` says (StreamingTOM: 4)
    start_here: str | None = None  # when a newcomer picks it first (`mmkv methods` opens with it)
    # params -> N: the memory is the newest N frames alone, prefilled fresh after the prompt
    # (SimpleStream); None: the memory follows the whole stream
    window: Callable[[Any], int] | None = None
    # it sizes its memory by parameters of its own (FluxMem's thresholds, DSCache's frame counts):
    # it takes no budget, yet keeps fewer tokens than it prefilled
    adaptive: bool = False
    # params -> N: the newest N frames are prefilled fresh after the prompt, apart from the memory
    # of the frames before them, and follow it in the pack (DSCache's instant cache)
    instant: Callable[[Any], int] | None = None

    @property
    def takes_budget(self) -> bool:
        return self.budget is not None

    @property
    def keeps_all(self) -> bool:
        return self.budget is None and not self.adaptive

    def abilities(self) -> list[str]:
        out = ["blockwise" if self.blockwise else "streaming"]
        if self.context is not None:
            out.append("retrieval")
        if self.prune_at_ask is not None:
            out.append("prune-at-ask")
        return out
