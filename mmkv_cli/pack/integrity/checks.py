"""A pack is untrusted input: what is checked before anything in it is used.

Three layers. The safetensors directory: every entry a known dtype, a sane shape, its byte range
exactly its shape's size, the ranges tiling the data without gaps or overlap. The header: a schema
of types and ranges for every field a reader or `ask` uses. The tensors: each one's dtype and shape
follow from the header (layers, KV heads, head dim, position dims, counts), and the block table's
offsets are exactly the running sums the writer makes. On top, one digest in the header ("index")
covers the directory and every small tensor that no per-block or per-span checksum covers (table,
times, checksums, series); "reps" covers the representatives, checked when they are read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from typing import TYPE_CHECKING

from mmkv_cli.core.errors import PackError, unreadable
from mmkv_cli.pack.integrity.hashing import new_digest
from mmkv_cli.pack.schema.format import (
    BLOCKS,
    EMBEDS,
    FORMAT_NAME,
    META_HEADER,
    META_HEADER_SHA,
    READABLE_VERSIONS,
    digest_name,
)

if TYPE_CHECKING:
    from mmkv_cli.pack.schema.header import PackHeader

MAX_HEADER_BYTES = 16 << 20  # safetensors directory + mmkv header; real ones are a few KB
MAX_DIMS = 8
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 4096
ELEMENT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1}
KV_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
STORED_KV_DTYPES = {code: name for name, code in KV_DTYPES.items()}
# small tensors covered by the header's index digest (present ones, in this order)
# (the table's digests are not: written after the blocks, a flip in one fails its block's check)
INDEXED = ("blocks.table", "blocks.time", "media.timestamps", "layout.step_lengths")
HEX64 = re.compile(r"[0-9a-f]{64}")


FIRST_READ = 64 << 10  # a kvpack's header is a few KB: fetched with the length in one request


def read_directory(fh, path, ensure=None) -> tuple[dict, int]:
    """The safetensors directory of the open file `fh`, checked; and where the data starts.
    ensure(ranges): makes byte ranges readable first (a remote pack's mirror)."""
    try:
        return _read_directory(fh, path, ensure)
    except OSError as err:  # EIO on the first bytes: a failing disk, /proc/self/mem
        raise unreadable(path, err) from None


def _read_directory(fh, path, ensure) -> tuple[dict, int]:
    size = os.fstat(fh.fileno()).st_size
    if ensure is not None:  # one request for the length and (usually) the whole header
        ensure([(0, min(size, FIRST_READ))])
    raw = os.pread(fh.fileno(), 8, 0)
    if len(raw) < 8:
        raise PackError(f"{path} is not a kvpack (empty or truncated)")
    (length,) = struct.unpack("<Q", raw)
    if length <= 0 or 8 + length > size:
        raise PackError(f"{path} is not a kvpack, or it is truncated")
    if length > MAX_HEADER_BYTES:  # refused before it is read: a kvpack's is a few KB
        raise PackError(f"{path} is not a kvpack (a {length:,}-byte header)")
    if ensure is not None:
        ensure([(8, 8 + length)])
    text = os.pread(fh.fileno(), length, 8)
    if len(text) != length:  # fewer bytes than the size just read: cut under the reader
        raise PackError(f"{path} changed while it was being read")
    # padded with spaces only, and no other whitespace between its tokens (the writers make it
    # compact; JSON strings hold none raw): bytes no checksum covers cannot change unseen
    if any(byte in text.rstrip(b" ") for byte in b"\t\n\r"):
        raise PackError(f"{path} is corrupted (whitespace in its directory)")
    try:
        header = json.loads(text, object_pairs_hook=_unique)
    except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, or a key given twice
        raise PackError(f"{path} is corrupted (unreadable header: {str(err)[:80]})") from None
    if not isinstance(header, dict):
        raise PackError(f"{path} is corrupted (unreadable header)")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    check_directory(entries, size - 8 - length, str(path))
    return header, 8 + length


def _unique(pairs: list[tuple]) -> dict:
    """A JSON object whose keys are all different: a tensor or field named twice would let two
    readers (mmkv, safetensors) see two different packs in one file."""
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key is given twice")
    return found


def parse_header(meta, where: str) -> dict:
    """The kvpack header from the safetensors metadata: its checksum, its JSON, its format and a
    version this mmkv reads (the fields themselves are check_header's)."""
    text = meta.get(META_HEADER) if isinstance(meta, dict) else None
    if not isinstance(text, str):
        raise PackError(f"{where} is a safetensors file but not a kvpack")
    if hashlib.sha256(text.encode()).hexdigest() != meta.get(META_HEADER_SHA):
        raise PackError(f"{where} is corrupted (header checksum mismatch)")
    try:
        header = json.loads(text, object_pairs_hook=_unique)
    except (ValueError, RecursionError):
        raise PackError(f"{where} is corrupted (unreadable header)") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise PackError(f"{where} is not a kvpack")
    version = header.get("format_version")
    if version not in READABLE_VERSIONS or type(version) is not int:
        raise PackError(
            f"{where} is kvpack format v{str(version)[:10]}; this mmkv reads "
            f"v{', v'.join(map(str, READABLE_VERSIONS))}"
        )
    return header


def check_directory(entries: dict, data_bytes: int, where: str) -> None:
    """Every tensor entry well formed, their byte ranges tiling [0, data_bytes) exactly."""
    ranges = []
    for name, entry in entries.items():
        if not isinstance(entry, dict) or len(name) > 128:
            raise PackError(f"{where} is corrupted (bad tensor entry {name[:40]!r})")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ELEMENT_BYTES:
            raise PackError(f"{where} is corrupted (tensor {name} has unknown dtype {dtype!r})")
        if not _ints(shape, 0, 1 << 40) or len(shape) > MAX_DIMS:
            raise PackError(f"{where} is corrupted (tensor {name} has a bad shape)")
        if not _ints(offsets, 0, data_bytes) or len(offsets) != 2:
            raise PackError(f"{where} is corrupted (tensor {name} has bad offsets)")
        if offsets[1] - offsets[0] != math.prod(shape) * ELEMENT_BYTES[dtype]:
            raise PackError(f"{where} is corrupted (tensor {name}'s size does not match its shape)")
        ranges.append(offsets)
    at = 0
    for start, stop in sorted(ranges):
        if start != at:
            raise PackError(f"{where} is corrupted (tensor byte ranges overlap or leave gaps)")
        at = stop
    if at != data_bytes:
        raise PackError(f"{where} is truncated or has trailing garbage")


def directory_text(entries: dict) -> bytes:
    """The directory as the index digest covers it: names, dtypes, shapes and offsets."""
    plain = {n: [e["dtype"], e["shape"], e["data_offsets"]] for n, e in sorted(entries.items())}
    return json.dumps(plain, separators=(",", ":")).encode()


def index_digest(entries: dict, tensor_bytes, algorithm: str) -> str:
    """The digest (`algorithm`) of the directory and the indexed tensors' bytes;
    tensor_bytes(name) gives them."""
    h = new_digest(algorithm)
    h.update(directory_text(entries))
    for name in INDEXED:
        if name in entries:
            h.update(tensor_bytes(name))
    return h.hexdigest()


def _ints(value, low: int, high: int) -> bool:
    return (
        isinstance(value, list)
        and all(type(v) is int and low <= v <= high for v in value)
        and len(value) < 1 << 16
    )


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise PackError(f"{where} is corrupted ({what})")


def _section(header: dict, key: str, where: str, required: bool = False) -> dict:
    value = header.get(key)
    if value is None and not required:
        return {}
    _need(isinstance(value, dict), where, f"'{key}' is not a mapping")
    return value


def _is_int(value, low: int = 0, high: int = 1 << 62) -> bool:
    return type(value) is int and low <= value <= high


def check_header(header: dict, version: int, where: str) -> None:
    """Types and ranges of every header field a reader or `ask` uses (those older versions lack
    may be absent; present ones are checked the same)."""
    current = version >= 7
    kv = _section(header, "kv", where, required=current)
    if current or kv:
        _need(_is_int(kv.get("layers"), 1, MAX_LAYERS), where, "kv.layers")
        _need(_is_int(kv.get("kv_heads"), 1, MAX_HEADS), where, "kv.kv_heads")
        _need(_is_int(kv.get("head_dim"), 2, MAX_HEAD_DIM), where, "kv.head_dim")
        dtype = kv.get("dtype")
        _need(isinstance(dtype, str) and dtype in KV_DTYPES, where, f"kv.dtype {str(dtype)[:20]!r}")
        per_head = kv.get("per_head", False)  # v11: the KV heads keep tokens of their own
        _need(per_head is False or (per_head is True and version >= 11), where, "kv.per_head")
        if per_head:
            _need(kv["layers"] * kv["kv_heads"] <= MAX_LAYERS, where, "kv.layers x kv.kv_heads")
    prompt = _section(header, "prompt", where)
    if prompt.get("question") is not None:  # null: absent, as a header built in code may say
        question = prompt["question"]
        _need(
            isinstance(question, str) and question.count("{question}") == 1,
            where,
            "the question template must hold '{question}' once",
        )
    layout = _section(header, "layout", where)
    if layout.get("next_position") is not None:
        _need(_is_int(layout["next_position"], 0, 2**31 - 1), where, "layout.next_position")
    if layout.get("position_limit") is not None:
        _need(_is_int(layout["position_limit"], 1, 2**31), where, "layout.position_limit")
    if layout.get("position_dims") is not None:
        _need(layout["position_dims"] in (1, 3), where, "layout.position_dims")
    if layout.get("frames_per_step") is not None:  # the short term a late interaction spares
        _need(_is_int(layout["frames_per_step"], 1, 64), where, "layout.frames_per_step")
    fingerprint = _section(header, "fingerprint", where)
    for key in ("model", "family", "config_sha256", "weights_sha256"):
        value = fingerprint.get(key)
        _need(value is None or (isinstance(value, str) and len(value) <= 512), where, key)
    method = _section(header, "method", where)
    for key in ("name", "implements"):
        value = method.get(key)
        _need(value is None or (isinstance(value, str) and len(value) <= 128), where, key)
    _need(isinstance(method.get("params", {}), dict), where, "method.params")
    share = method.get("budget")
    _need(
        share is None or (type(share) in (int, float) and math.isfinite(share) and 0 < share <= 1),
        where,
        "method.budget",
    )
    tokens = method.get("budget_tokens")
    _need(tokens is None or _is_int(tokens, 1, 1 << 40), where, "method.budget_tokens")
    media = _section(header, "media", where)
    for key, longest in (("kind", 32), ("source", 4096), ("digest", 256)):
        value = media.get(key)
        _need(value is None or (isinstance(value, str) and len(value) <= longest), where, key)
    _need(media.get("frames") is None or _is_int(media["frames"]), where, "media.frames")
    created = header.get("created")
    _need(created is None or (isinstance(created, str) and len(created) <= 64), where, "created")
    reduce = method.get("reduce")
    _need(
        reduce is None
        or (
            isinstance(reduce, dict)
            and isinstance(reduce.get("name"), str)
            and len(reduce["name"]) <= 64
            and isinstance(reduce.get("params", {}), dict)
        ),
        where,
        "method.reduce",
    )
    stats = header.get("stats") or {}
    if isinstance(stats, dict) and stats.get("visual_tokens_prefilled") is not None:
        prefilled, total = stats["visual_tokens_prefilled"], header.get("visual_tokens_total")
        fits = _is_int(prefilled) and (not _is_int(total) or prefilled <= total)
        _need(fits, where, "stats.visual_tokens_prefilled")
    if header.get("visual_tokens_total") is not None:
        _need(_is_int(header["visual_tokens_total"]), where, "visual_tokens_total")
    blocks = _section(header, "blocks", where, required=version >= 3)
    if version >= 3:
        _need(_is_int(blocks.get("count"), 0, 1 << 40), where, "blocks.count")
        kinds = blocks.get("granularities")
        _need(
            isinstance(kinds, list)
            and len(kinds) <= 64
            and all(isinstance(k, str) and len(k) <= 32 for k in kinds),
            where,
            "blocks.granularities",
        )
        # v12: stored layers each of a block's digests covers (checked against the layers with
        # the tensors' shapes)
        runs = blocks.get("digest_layers")
        _need(version < 12 or _is_int(runs, 1, 1 << 20), where, "blocks.digest_layers")
    reps = header.get("representatives")
    if reps is not None:
        _need(isinstance(reps, dict) and _is_int(reps.get("dim"), 1, 1 << 20), where, "reps")
        # absent before v6 (means after RoPE); named since
        _need(reps.get("space") in (None, "pre_rope", "post_rope"), where, "reps.space")
    embeddings = header.get("embeddings")
    if embeddings is not None:  # v13: the blocks' tokens as taken in
        dim = embeddings.get("dim") if isinstance(embeddings, dict) else None
        _need(version >= 13 and _is_int(dim, 1, 1 << 16), where, "embeddings")
    if current:
        digests = _section(header, "integrity", where, required=True)
        _need(
            isinstance(digests.get("index"), str) and HEX64.fullmatch(digests["index"]),
            where,
            "integrity",
        )
        if "reps" in digests:
            _need(_reps_digest(digests["reps"], version), where, "integrity.reps")
        if header.get("embeddings") is not None:
            embeds = digests.get(EMBEDS)
            _need(_reps_digest(embeds, version), where, "integrity.embeds")
        if "key_scales" in digests:
            scales = _reps_digest(digests["key_scales"], max(8, version))
            _need(scales, where, "integrity.key_scales")


def _reps_digest(value, version: int) -> bool:
    """v8: {"chunk": bytes, "sha256": [one digest per chunk]} (v10: "blake3"); v7: one digest."""
    if version < 8:
        return isinstance(value, str) and HEX64.fullmatch(value) is not None
    key = digest_name(version)
    return (
        isinstance(value, dict)
        and _is_int(value.get("chunk"), 1 << 16, 1 << 30)
        and isinstance(value.get(key), list)
        and len(value[key]) <= 1 << 16
        and all(isinstance(d, str) and HEX64.fullmatch(d) for d in value[key])
    )


def check_kv_shape(kv, where: str) -> None:
    """A KV shape (stored, or read off an old pack's tensors) within the bounds of a real model."""
    _need(1 <= kv.layers <= MAX_LAYERS, where, "kv layers")
    _need(1 <= kv.kv_heads <= MAX_HEADS, where, "kv heads")
    _need(2 <= kv.head_dim <= MAX_HEAD_DIM, where, "kv head dim")


def check_askable(header: PackHeader, where: str) -> None:
    """The fields `ask` reads are all there. Their types and ranges were checked on open
    (check_header); a pack that only stores KV, as some tests write, need not have them."""
    missing = header.missing_for_ask()
    _need(missing is None, where, f"no {missing}")


def check_spans(spans: dict, layers: int, version: int, where: str) -> None:
    key = digest_name(version)
    for name in ("prefix", "suffix"):
        meta = spans.get(name)
        _need(isinstance(meta, dict), where, f"no {name}")
        counts = meta.get("layer_counts")
        _need(_ints(counts, 0, 1 << 40) and len(counts) == layers, where, f"{name} counts")
        sha = meta.get(key)
        _need(isinstance(sha, str) and HEX64.fullmatch(sha) is not None, where, f"{name} {key}")
        _need(isinstance(meta.get("shared_positions", False), bool), where, f"{name} positions")


def uncovered(version: int, header: dict, entries: dict) -> list[str]:
    """What a pack of format `version` stores with no checksum over it: checked on open for shape
    and sense only (v8: nothing; v7: the representatives when it lacks their digest)."""
    out = []
    if version < 7:
        out = ["the tensor directory"] if version >= 3 else []
        named = {
            f"{BLOCKS}.table": "the block table",
            f"{BLOCKS}.time": "block times",
            "media.timestamps": "frame timestamps",
            "layout.step_lengths": "tokens per step",
        }
        out += [what for name, what in named.items() if name in entries]
    if header.get("representatives") and (header.get("integrity") or {}).get("reps") is None:
        out.append("representatives")
    return out


def check_positions(positions: list, layout, path: str, what: str) -> None:
    """Refuse stored positions [P, n] (each a torch tensor on the host) outside the stream's
    range: a checksum says the bytes are the writer's, not that the writer was sane, and a
    position out there places a token anywhere. 1-D RoPE: 0 .. position_limit - 1 (older packs:
    the question's first position). M-RoPE: a compaction moves a token's three axes alike, so its
    height and width may go below 0, never past -position_limit (older packs: unchecked)."""
    import torch

    limit = layout.position_limit
    three = layout.position_dims == 3
    if limit is None and not three:
        limit = layout.next_position
    held = [p for p in positions if p.numel()]
    if not held or (limit is None and three):
        return
    low = torch.stack([p.amin() for p in held]).min()
    high = torch.stack([p.amax() for p in held]).max()
    floor = -limit if three and limit is not None else 0
    if int(low) < floor or (limit is not None and int(high) >= limit):
        bound = f"{floor}..{limit - 1}" if limit is not None else f"{floor} or more"
        raise PackError(f"{path} is corrupted (a position of {what} outside {bound})")
