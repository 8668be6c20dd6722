"""The pack header, typed: what an encode records about itself (the model's fingerprint, the method,
the media, the prompt, the stream's layout and rotary settings, the KV's shape, the encode's stats).

Built once at encode, written by the writer, and returned by the reader already upgraded from the
format version that stored it (v2-v8), so no code outside pack/ reads a header by string key or
branches on its version. The storage's own bookkeeping (spans, block table, quantization,
representatives, integrity) stays the writer's and the reader's.

Every section keeps the fields mmkv reads as typed attributes and anything else it holds, as
stored, in `extra`: a header read and written again (convert) loses nothing. Types and ranges were
checked on open (integrity.check_header) before a section is built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack.schema.format import FORMAT_VERSION


def _split(cls: type, stored: Any) -> dict[str, Any]:
    """`stored` (a header section) as keyword arguments of `cls`: declared keys by name, the rest
    kept in `extra`."""
    stored = stored if isinstance(stored, dict) else {}
    declared = {f.name for f in fields(cls) if f.metadata.get("stored", True)} - {"extra"}
    known = {k: v for k, v in stored.items() if k in declared}
    return {**known, "extra": {k: v for k, v in stored.items() if k not in declared}}


@dataclass(frozen=True)
class Section:
    """A header section: typed fields, then `extra` (what else it stores, kept as is)."""

    @classmethod
    def stored(cls, section: Any):
        return cls(**_split(cls, section))

    def as_stored(self) -> dict[str, Any]:
        """The section as the header's JSON holds it."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "extra"
            and f.metadata.get("stored", True)
            and not (f.metadata.get("when_set") and getattr(self, f.name) is None)
        }
        return {**out, **self.extra}


@dataclass(frozen=True)
class Fingerprint(Section):
    """Which model made the KV: a preset, hub id or path, and digests telling checkpoints apart."""

    model: str | None = None
    source: str | None = None
    family: str | None = None
    revision: str | None = None
    config_sha256: str | None = None
    weights_sha256: str | None = None
    transformers: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MethodRecord(Section):
    """The method as the user chose it (name: a method or a preset) and the method in code it is."""

    name: str | None = None
    implements: str | None = None  # the method in code (a preset names its own); None: `name`
    budget: float | None = None  # the share asked for (None with a token budget, or none)
    budget_tokens: int | None = None
    params: dict = field(default_factory=dict)  # the parameter class's fields, as plain data
    guidance_prompt: str | None = None
    # the token reducer before the prefill: {name, params}; absent from packs made without one
    reduce: dict | None = field(default=None, metadata={"when_set": True})
    extra: dict = field(default_factory=dict)
    # False for v2-v4 packs, which kept other keys beside the parameters: apply those that still
    # fit the class (not stored: a pack written now holds the class's fields alone)
    params_exact: bool = field(default=True, metadata={"stored": False})

    @property
    def in_code(self) -> str | None:
        """The registry name of the method the pack was encoded with."""
        return self.implements or self.name


@dataclass(frozen=True)
class MediaRecord(Section):
    """What was encoded (its timestamps are a tensor: reader.series("media.timestamps"))."""

    kind: str | None = None  # video | images | pdf
    source: str | None = None  # the path or URL as given
    digest: str | None = None  # sha256 of the media's bytes
    frames: int | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PromptRecord(Section):
    """The text around the visual tokens, as the backbone's chat template lays it."""

    prefix: str | None = None  # before the visual tokens
    suffix_text: str | None = None  # after them
    question: str | None = None  # the question's template: "{question}" once
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class LayoutRecord(Section):
    """Where the stream sits in position space (its tokens per step are a tensor:
    reader.series("layout.step_lengths"))."""

    position_dims: int | None = None  # 1 (RoPE) or 3 (M-RoPE)
    next_position: int | None = None  # the question's first position
    rope_deltas: int | None = None  # M-RoPE: text positions past the visual grid
    position_shift: int | None = None  # subtracted from every later position by compaction
    frames_per_step: int | None = None
    steps: int | None = None
    tokens_per_step: int | None = None
    grid: list | None = None  # the visual grid of a step (height, width), in tokens
    frame_size: list | None = None  # a frame's height and width, in pixels
    # every stored position is below it (issue 74): the stream's highest position + 1, the
    # question's first one included (M-RoPE places a video's time positions past the text after
    # it); absent from packs written before, where 1-D layouts have next_position instead
    position_limit: int | None = field(default=None, metadata={"when_set": True})
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class KVShape:
    """The language model's KV as stored in the prefix: layers, KV heads, head width and dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # float32 | float16 | bfloat16
    # the KV heads keep tokens of their own (v11): every span stores each (layer, KV head) as a
    # layer of one head, layer-major (`stored`)
    per_head: bool = False

    def as_stored(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.per_head:  # as before v11
            del out["per_head"]
        return out

    @property
    def stored(self) -> KVShape:
        """The shape the spans are stored in: per head, layers x heads layers of one head."""
        if not self.per_head:
            return self
        return KVShape(self.layers * self.kv_heads, 1, self.head_dim, self.dtype)


def stored_kv(kv: dict | None) -> dict | None:
    """A header's (checked) "kv" section as the spans are stored: held per head, layers x heads
    layers of one head."""
    if not kv or not kv.get("per_head"):
        return kv
    return {**kv, "layers": kv["layers"] * kv["kv_heads"], "kv_heads": 1}


@dataclass(frozen=True)
class PackHeader:
    """Everything an encode records about itself."""

    kv: KVShape
    fingerprint: Fingerprint = field(default_factory=Fingerprint)
    method: MethodRecord = field(default_factory=MethodRecord)
    media: MediaRecord = field(default_factory=MediaRecord)
    prompt: PromptRecord = field(default_factory=PromptRecord)
    layout: LayoutRecord = field(default_factory=LayoutRecord)
    rotary: dict = field(default_factory=dict)  # what a context policy needs to re-rotate keys
    visual_tokens_total: int | None = None  # visual tokens the media gave, before compression
    stats: dict = field(default_factory=dict)  # the encode's own measures (time, peak KV bytes)
    created: str | None = None  # ISO 8601, UTC
    mmkv_version: str | None = None
    converted: dict | None = None  # set by `mmkv convert`: from what, when, which blocks
    format_version: int = FORMAT_VERSION  # the version the pack was stored in (read packs)

    def sections(self) -> dict[str, Any]:
        """The header's JSON sections as the writer stores them (it adds its own bookkeeping)."""
        optional = {"created": self.created, "mmkv_version": self.mmkv_version}
        out = {
            **{k: v for k, v in optional.items() if v is not None},
            "fingerprint": self.fingerprint.as_stored(),
            "method": self.method.as_stored(),
            "media": self.media.as_stored(),
            "prompt": self.prompt.as_stored(),
            "layout": self.layout.as_stored(),
            "rotary": dict(self.rotary),
            "kv": self.kv.as_stored(),
            "visual_tokens_total": self.visual_tokens_total,
            "stats": dict(self.stats),
        }
        if self.converted is not None:
            out["converted"] = dict(self.converted)
        return out

    def missing_for_ask(self) -> str | None:
        """The first field `ask` needs that this header lacks (a pack that only stores KV, as
        some tests write, need not have them), or None."""
        needed = {
            "fingerprint.model": self.fingerprint.model,
            "fingerprint.family": self.fingerprint.family,
            "prompt.question": self.prompt.question,
            "layout.next_position": self.layout.next_position,
            "layout.position_dims": self.layout.position_dims,
        }
        return next((name for name, value in needed.items() if value is None), None)


def read_header(stored: dict, version: int, kv: KVShape, where: str) -> PackHeader:
    """The typed header of a pack stored at `version` (its fields checked by check_header). kv: the
    KV's shape, from the header where it says (v7 on) or else from the prefix tensors."""
    method = stored.get("method") or {}
    if version < 5:  # v2-v4 kept a fixed token budget among the parameters
        method = dict(method)
        params = dict(method.get("params") or {})
        if method.get("budget_tokens") is None and isinstance(params.get("budget_tokens"), int):
            method["budget_tokens"] = params["budget_tokens"]
        method["params"] = params
    exact = version >= 5
    try:
        return PackHeader(
            kv=kv,
            fingerprint=Fingerprint.stored(stored.get("fingerprint")),
            method=replace(MethodRecord.stored(method), params_exact=exact),
            media=MediaRecord.stored(stored.get("media")),
            prompt=PromptRecord.stored(stored.get("prompt")),
            layout=LayoutRecord.stored(stored.get("layout")),
            rotary=dict(stored.get("rotary") or {}),
            visual_tokens_total=stored.get("visual_tokens_total"),
            stats=dict(stored.get("stats") or {}),
            created=stored.get("created"),
            mmkv_version=stored.get("mmkv_version"),
            converted=stored.get("converted"),
            format_version=version,
        )
    except (TypeError, ValueError) as err:
        raise PackError(f"{where} is corrupted (header: {err})") from None
