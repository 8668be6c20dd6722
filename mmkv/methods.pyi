# Written by `python -m mmkv._stubs` from the method registry: do not edit.
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from mmkv_cli.core.options import EncodeOptions, MethodSpec
from mmkv_cli.methods.hermes import Smoothing
from mmkv_cli.methods.mukv import Counts
from mmkv_cli.methods.mukv import Shares

__all__ = ["MethodConfig", "get", "Full", "Recency", "ReKV", "MuKV", "HERMES", "InfiniPotV", "SnapKV", "H2O", "PyramidKV", "AirCache", "MEDA", "StreamingTOM", "StreamMem", "SimpleStream", "CausalMem", "FluxMem", "DSCache", "SAVEMem"]

class MethodConfig:
    """A method with its parameters, each checked when it is built."""
    method: ClassVar[str]
    budget: float | None
    budget_tokens: int | None
    reduce: str | None
    reduce_params: Mapping[str, Any] | None
    def spec(self) -> MethodSpec: ...
    def encode_options(self, **options: Any) -> EncodeOptions: ...

def get(name: str, **changes: Any) -> MethodConfig: ...

CLASSES: dict[str, type[MethodConfig]]


class Full(MethodConfig):
    """Full: keep the whole KV cache (reference)."""
    chunk_frames: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
    ) -> None: ...


class Recency(MethodConfig):
    """Recency: keep the prompt (attention sinks) and the newest visual tokens."""
    chunk_frames: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
    ) -> None: ...


class ReKV(MethodConfig):
    """ReKV: whole stream, one block per frame, top-k retrieval by the question."""
    chunk_frames: int
    window_tokens: int | None
    k: int
    query: Literal['query_mean', 'last_key']
    positions: Literal['keep', 'reindex']
    similarity: Literal['dot', 'cosine']
    layers: Literal['each', 'last']
    retrieve: Literal['in_forward', 'two_pass']
    chunk_size: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        window_tokens: int | None = ...,
        k: int = ...,
        query: Literal['query_mean', 'last_key'] = ...,
        positions: Literal['keep', 'reindex'] = ...,
        similarity: Literal['dot', 'cosine'] = ...,
        layers: Literal['each', 'last'] = ...,
        retrieve: Literal['in_forward', 'two_pass'] = ...,
        chunk_size: int = ...,
    ) -> None: ...


class MuKV(MethodConfig):
    """MuKV: multi-grained blocks, dual-signal compression, hierarchical retrieval."""
    chunk_frames: int
    segment_frames: int
    views: Literal['stream', 'middle_frame']
    patch_blocks: Literal['raster', 'spatial']
    rho: Shares | Mapping[str, Any]
    alpha: Shares | Mapping[str, Any]
    frequency: Literal['fft', 'diff']
    batch_tokens: int
    query: Literal['last_key', 'query_mean']
    key_space: Literal['placed', 'position_free']
    k: Counts | Mapping[str, Any]
    rerank: Shares | Mapping[str, Any]
    top_segments: int
    positions: Literal['keep', 'reindex']
    similarity: Literal['cosine', 'dot']
    layers: Literal['last', 'each']
    dedup: bool
    dedup_similarity: float
    dedup_candidates: float
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        segment_frames: int = ...,
        views: Literal['stream', 'middle_frame'] = ...,
        patch_blocks: Literal['raster', 'spatial'] = ...,
        rho: Shares | Mapping[str, Any] = ...,
        alpha: Shares | Mapping[str, Any] = ...,
        frequency: Literal['fft', 'diff'] = ...,
        batch_tokens: int = ...,
        query: Literal['last_key', 'query_mean'] = ...,
        key_space: Literal['placed', 'position_free'] = ...,
        k: Counts | Mapping[str, Any] = ...,
        rerank: Shares | Mapping[str, Any] = ...,
        top_segments: int = ...,
        positions: Literal['keep', 'reindex'] = ...,
        similarity: Literal['cosine', 'dot'] = ...,
        layers: Literal['last', 'each'] = ...,
        dedup: bool = ...,
        dedup_similarity: float = ...,
        dedup_candidates: float = ...,
    ) -> None: ...


class HERMES(MethodConfig):
    """HERMES: streaming layered memory, fixed 4K-token budget, summary token, no retrieval."""
    chunk_frames: int
    guidance_prompt: str | None
    shallow_share: float
    deep_share: float
    curves: Literal['backbone', 'llava_ov', 'qwen']
    recency_k: tuple[float, float] | None
    middle_a: tuple[float, float] | None
    smoothing: Smoothing | Mapping[str, Any]
    prompts: Literal['roles', 'one']
    local_question: str
    global_question: str
    previous_turn: bool
    summary: bool
    summary_as: Literal['token', 'running_mean']
    summary_at: Literal['after_kept', 'after_prompt']
    reindex: Literal['eager', 'lazy']
    reindex_at: int | None
    continue_at: Literal['layer_end', 'stream']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        guidance_prompt: str | None = ...,
        shallow_share: float = ...,
        deep_share: float = ...,
        curves: Literal['backbone', 'llava_ov', 'qwen'] = ...,
        recency_k: tuple[float, float] | None = ...,
        middle_a: tuple[float, float] | None = ...,
        smoothing: Smoothing | Mapping[str, Any] = ...,
        prompts: Literal['roles', 'one'] = ...,
        local_question: str = ...,
        global_question: str = ...,
        previous_turn: bool = ...,
        summary: bool = ...,
        summary_as: Literal['token', 'running_mean'] = ...,
        summary_at: Literal['after_kept', 'after_prompt'] = ...,
        reindex: Literal['eager', 'lazy'] = ...,
        reindex_at: int | None = ...,
        continue_at: Literal['layer_end', 'stream'] = ...,
    ) -> None: ...


class InfiniPotV(MethodConfig):
    """InfiniPotV: streaming under a memory cap: temporal redundancy and value norms, no question."""
    chunk_frames: int
    tar_share: float
    recent_share: float
    reference: Literal['recent', 'previous']
    reference_count: Literal['held_tokens', 'held_steps']
    pooling: Literal['none', 'layer_adaptive']
    pairing: Literal['cache_slot', 'spatial']
    selection: Literal['per_head', 'per_layer']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        tar_share: float = ...,
        recent_share: float = ...,
        reference: Literal['recent', 'previous'] = ...,
        reference_count: Literal['held_tokens', 'held_steps'] = ...,
        pooling: Literal['none', 'layer_adaptive'] = ...,
        pairing: Literal['cache_slot', 'spatial'] = ...,
        selection: Literal['per_head', 'per_layer'] = ...,
    ) -> None: ...


class SnapKV(MethodConfig):
    """SnapKV: top visual tokens per KV head by a guidance prompt's attention (pooled)."""
    chunk_frames: int
    guidance_prompt: str | None
    pool_kernel: int
    selection: Literal['per_head', 'per_layer']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        guidance_prompt: str | None = ...,
        pool_kernel: int = ...,
        selection: Literal['per_head', 'per_layer'] = ...,
    ) -> None: ...


class H2O(MethodConfig):
    """H2O: top visual tokens per KV head by the attention all prefill queries paid them."""
    chunk_frames: int
    score_every: int
    selection: Literal['per_head', 'per_layer']
    head_budgets: Literal['equal', 'adaptive']
    head_floor: float
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        score_every: int = ...,
        selection: Literal['per_head', 'per_layer'] = ...,
        head_budgets: Literal['equal', 'adaptive'] = ...,
        head_floor: float = ...,
    ) -> None: ...


class PyramidKV(MethodConfig):
    """PyramidKV: SnapKV scores, budgets falling from shallow to deep layers."""
    chunk_frames: int
    guidance_prompt: str | None
    pool_kernel: int
    selection: Literal['per_head', 'per_layer']
    beta: float
    large_budget: Literal['uniform', 'clamp']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        guidance_prompt: str | None = ...,
        pool_kernel: int = ...,
        selection: Literal['per_head', 'per_layer'] = ...,
        beta: float = ...,
        large_budget: Literal['uniform', 'clamp'] = ...,
    ) -> None: ...


class AirCache(MethodConfig):
    """AirCache: visual KV pruned by an elite window of the instruction; per-layer budgets."""
    chunk_frames: int
    guidance_prompt: str | None
    tau: float
    min_layer_ratio: float
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        guidance_prompt: str | None = ...,
        tau: float = ...,
        min_layer_ratio: float = ...,
    ) -> None: ...


class MEDA(MethodConfig):
    """MEDA: per-layer budgets from cross-modal attention entropy, kept per KV head, evicted KV merged into kept."""
    chunk_frames: int
    guidance_prompt: str | None
    min_layer_ratio: float
    recent_share: float
    merge: bool
    merge_into: Literal['text_and_visual', 'visual']
    merge_form: Literal['pivot', 'mean']
    entropy_heads: Literal['per_head', 'head_mean']
    score_every: int
    selection: Literal['per_head', 'per_layer']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        guidance_prompt: str | None = ...,
        min_layer_ratio: float = ...,
        recent_share: float = ...,
        merge: bool = ...,
        merge_into: Literal['text_and_visual', 'visual'] = ...,
        merge_form: Literal['pivot', 'mean'] = ...,
        entropy_heads: Literal['per_head', 'head_mean'] = ...,
        score_every: int = ...,
        selection: Literal['per_head', 'per_layer'] = ...,
    ) -> None: ...


class StreamingTOM(MethodConfig):
    """StreamingTOM: a fixed count of tokens a frame before the LM, a 4-bit memory, frames retrieved."""
    chunk_frames: int
    window_tokens: int | None
    retrieve_frames: int
    positions: Literal['reindex', 'keep']
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        window_tokens: int | None = ...,
        retrieve_frames: int = ...,
        positions: Literal['reindex', 'keep'] = ...,
    ) -> None: ...


class StreamMem(MethodConfig):
    """StreamMem: a fixed memory scored by the chat template's attention, one prototype a frame."""
    chunk_frames: int
    proxy: str
    prototypes: bool
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        proxy: str = ...,
        prototypes: bool = ...,
    ) -> None: ...


class SimpleStream(MethodConfig):
    """SimpleStream: no memory: the newest frames alone, prefilled fresh (the recency control)."""
    chunk_frames: int
    frames: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        frames: int = ...,
    ) -> None: ...


class CausalMem(MethodConfig):
    """CausalMem: a fixed budget: tokens an online semantic basis explains least; one mean a frame."""
    chunk_frames: int
    k_max: int
    decay: float
    new_directions: int
    time_weight: float
    min_foreground: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        k_max: int = ...,
        decay: float = ...,
        new_directions: int = ...,
        time_weight: float = ...,
        min_foreground: int = ...,
    ) -> None: ...


class FluxMem(MethodConfig):
    """FluxMem: newest frames whole, then what differs from its neighbours, then merged regions."""
    chunk_frames: int
    short_term_frames: int
    mid_term_frames: int
    direct_drop_similarity: float
    pair_similarity: float | None
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        short_term_frames: int = ...,
        mid_term_frames: int = ...,
        direct_drop_similarity: float = ...,
        pair_similarity: float | None = ...,
    ) -> None: ...


class DSCache(MethodConfig):
    """DSCache: a sliding past cache placed without gaps, and the newest frames prefilled fresh."""
    chunk_frames: int
    context_len: int
    frame_len: int
    past_stride: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        context_len: int = ...,
        frame_len: int = ...,
        past_stride: int = ...,
    ) -> None: ...


class SAVEMem(MethodConfig):
    """SAVEMem: FluxMem's tiers kept by pseudo-questions' importance; a recency gate and the question's late interaction choose at ask."""
    chunk_frames: int
    short_term_frames: int
    mid_term_frames: int
    direct_drop_similarity: float
    pair_similarity: float | None
    scene_change: float
    protection: float
    pseudo_questions: tuple[str, ...]
    semantic_long_term: int
    max_memory_tokens: int
    gate_drop_ratio: float | None
    retrieval_top_k: int
    def __init__(
        self,
        *,
        budget: float | None = ...,
        budget_tokens: int | None = ...,
        reduce: str | None = ...,
        reduce_params: Mapping[str, Any] | None = ...,
        chunk_frames: int = ...,
        short_term_frames: int = ...,
        mid_term_frames: int = ...,
        direct_drop_similarity: float = ...,
        pair_similarity: float | None = ...,
        scene_change: float = ...,
        protection: float = ...,
        pseudo_questions: tuple[str, ...] = ...,
        semantic_long_term: int = ...,
        max_memory_tokens: int = ...,
        gate_drop_ratio: float | None = ...,
        retrieval_top_k: int = ...,
    ) -> None: ...
