"""What the facade's verbs return: typed records over what the CLI prints with --json. Each keeps
the whole record in `details` (the CLI's JSON, for fields not lifted into attributes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PackInfo:
    """What a pack holds, as `mmkv inspect --json` prints it.

    Attributes:
        path: where the pack is (a path or a URL).
        format_version: the pack format it is written in.
        model: the backbone it was encoded with (a preset, an HF id or a folder's name).
        method: the method or preset that compressed it.
        budget: the share of visual tokens the method was asked to keep (None: a count, or all).
        budget_tokens: the visual tokens per layer it was asked to keep (None: a share, or all).
        media_kind: video, images or pdf.
        media_source: the media it was encoded from, as named then.
        frames: frames (or images, or pages) encoded.
        blocks: blocks stored.
        visual_tokens_kept: visual tokens kept per layer, on average.
        visual_kv_share: the share of the visual KV kept.
        bytes: the pack's size on disk.
        kv_bits: bits each stored visual K/V value takes.
        per_head: each KV head keeps tokens of its own (format v11; each layer's `heads` counts
            are in details["layers"]).
        details: everything `inspect --json` prints.
    """

    path: str
    format_version: int
    model: str
    method: str
    budget: float | None
    budget_tokens: int | None
    media_kind: str
    media_source: str
    frames: int
    blocks: int
    visual_tokens_kept: float
    visual_kv_share: float
    bytes: int
    kv_bits: float
    per_head: bool
    details: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> PackInfo:
        """The typed view of an `inspect --json` record."""
        return cls(**_pack_fields(record), details=record)


@dataclass(frozen=True)
class EncodeResult(PackInfo):
    """A pack just written (its `PackInfo`) and what writing it took, as `mmkv encode --json`
    prints it.

    Attributes:
        encode_s: seconds the encode took, media decoding and model forwards included.
        peak_kv_bytes: the most KV the running cache held at once while encoding.
    """

    encode_s: float = 0.0
    peak_kv_bytes: int | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> EncodeResult:
        """The typed view of an `encode --json` record."""
        return cls(
            **_pack_fields(record),
            details=record,
            encode_s=float(record.get("encode_s", 0.0)),
            peak_kv_bytes=record.get("peak_kv_bytes"),
        )


def _pack_fields(record: dict[str, Any]) -> dict[str, Any]:
    media = record.get("media") or {}
    return {
        "path": str(record["path"]),
        "format_version": record["format_version"],
        "model": record["model"],
        "method": record["method"],
        "budget": record.get("budget"),
        "budget_tokens": record.get("budget_tokens"),
        "media_kind": media.get("kind", ""),
        "media_source": media.get("source", ""),
        "frames": media.get("frames", 0),
        "blocks": record["blocks"],
        "visual_tokens_kept": record.get("visual_tokens_kept", 0.0),
        "visual_kv_share": record.get("visual_kv_share", 1.0),
        "bytes": record["bytes"],
        "kv_bits": record.get("kv_bits", 16),
        "per_head": bool(record.get("per_head", False)),
    }


@dataclass(frozen=True)
class VerifyReport:
    """Every byte of a pack checked, as `mmkv verify --json` prints it.

    Attributes:
        path: the pack checked.
        ok: True when every checksum matched.
        faults: one line per block or tensor whose bytes do not match.
        bytes: the pack's size.
        bytes_checked: bytes read and hashed.
        details: everything `verify --json` prints.
    """

    path: str
    ok: bool
    faults: list[str]
    bytes: int
    bytes_checked: int
    details: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> VerifyReport:
        """The typed view of a `verify --json` record."""
        return cls(
            path=str(record["path"]),
            ok=bool(record["ok"]),
            faults=list(record["faults"]),
            bytes=record["bytes"],
            bytes_checked=record["bytes_checked"],
            details=record,
        )


@dataclass(frozen=True)
class LiveAnswer:
    """One answer from a live stream's memory, as `mmkv live --json` prints it.

    Attributes:
        question: the question asked.
        answer: the text (None when it failed: see error).
        at: the moment the question asked for (None: when it arrived).
        moment: the stream moment (seconds) whose memory answered.
        ttft_s: seconds from the question's turn to its first token, snapshot included.
        behind_s: how far the encode was behind the source when it answered.
        error: why no answer came (None: it did).
        note: what to know about it (a moment past the stream's end, say).
        id: the id it was asked with.
        details: everything `live --json` prints for it.
    """

    question: str
    answer: str | None
    at: float | None = None
    moment: float | None = None
    ttft_s: float | None = None
    behind_s: float | None = None
    error: str | None = None
    note: str | None = None
    id: str | int | None = None
    details: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> LiveAnswer:
        """The typed view of one answer record of `live --json`."""
        keys = ("at", "moment", "ttft_s", "behind_s", "error", "note", "id")
        return cls(
            question=record["question"],
            answer=record.get("answer"),
            **{key: record.get(key) for key in keys},
            details=record,
        )


@dataclass(frozen=True)
class LiveResult:
    """How a live stream ended and what it left, as `mmkv live --json`'s last line says.

    Attributes:
        path: the pack holding the memory at the end.
        stopped: ended (the source ended), stopped, interrupted or broken.
        error: what broke the source (None: nothing did).
        moment: the last frame's moment, seconds.
        frames: frames encoded.
        dropped: frames dropped to keep up (behind="drop").
        snapshots: packs published on the way.
        bytes: the final pack's size.
    """

    path: str
    stopped: str
    error: str | None
    moment: float
    frames: int
    dropped: int
    snapshots: int
    bytes: int

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> LiveResult:
        """The typed view of a follow's summary."""
        return cls(**{name: record[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of a method: its name, type, default and meaning.

    Attributes:
        name: the keyword its method class takes.
        type: the type, as `mmkv methods --json` writes it.
        default: the authors' default (or the preset's value).
        doc: one line of meaning.
    """

    name: str
    type: str
    default: Any
    doc: str


@dataclass(frozen=True)
class MethodInfo:
    """A compression method or preset, as `mmkv methods --json` lists it.

    Attributes:
        name: the name encode takes (a method, or a preset over one).
        implements: the method in code it runs (its class: `mmkv.methods.<label>`).
        label: that method's class name under `mmkv.methods`.
        description: one line on what it keeps.
        paper: the paper's title.
        year: the paper's year.
        budget_share: its default share of visual tokens (None: a count, or it keeps all).
        budget_tokens: its default visual tokens per layer (None: a share, or it keeps all).
        params: every parameter, at this method's or preset's value.
    """

    name: str
    implements: str
    label: str
    description: str
    paper: str
    year: int
    budget_share: float | None
    budget_tokens: int | None
    params: list[ParamInfo]


@dataclass(frozen=True)
class ModelInfo:
    """A model preset, as `mmkv models --json` lists it.

    Attributes:
        name: the name --model takes.
        family: llava_onevision, qwen2_vl, qwen2_5_vl or qwen3_vl.
        source: its HF id or built-in source.
        weights: built in, here (a local folder or the hub cache) or hub (to download).
        description: one line on what it is.
        default: True for the model encode uses when none is named.
    """

    name: str
    family: str | None
    source: str
    weights: str
    description: str
    default: bool


@dataclass(frozen=True)
class EvalResult:
    """An accuracy-against-budget study, as `mmkv eval --json` prints it.

    Attributes:
        runs: per method and budget, its accuracy, kept share and timings (the CLI's records).
        plot: the accuracy-against-budget figure written beside the runs.
    """

    runs: list[dict[str, Any]]
    plot: str
