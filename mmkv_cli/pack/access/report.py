"""What a pack holds and whether it is whole, from the pack alone: no model, and `inspect` reads
only the header and the block table (no torch)."""

from __future__ import annotations

from pathlib import Path

from mmkv_cli.core.errors import PackError, unreadable
from mmkv_cli.pack.access.reader import PackReader

BYTES_PER_VALUE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def verify(pack: str | Path) -> dict:
    """Every byte of a pack read and checked (inspect stays lazy): the header and directory on
    open, the prefix, suffix, representatives and embeddings, and every block against its
    checksum. Returns the faults found, each naming the block or tensor; none means the pack is
    whole."""
    reader = PackReader(pack)  # a fault here is one clear error: nothing after it can be trusted
    faults = []
    # numpy reads and checks what is stored as computed; torch is imported only to decode a
    # quantized pack's blocks
    for name in ("prefix", "suffix"):
        try:
            reader.span_arrays(name)
        except PackError as err:
            faults.append(f"{name}: {err}")
    for what, read in (("representatives", reader.stored_representatives),
                       ("embeddings", reader.stored_embeddings)):  # fmt: skip
        try:
            read()
        except PackError as err:
            faults.append(f"{what}: {err}")
    if len(reader.blocks) and reader.format_version >= 4:
        faults += reader.block_faults()
    elif len(reader.blocks):  # head-major packs: block by block
        for index in range(len(reader.blocks)):
            try:
                reader.span(reader.blocks.name(index), keep=False)
            except PackError as err:
                faults.append(f"block {reader.blocks.name(index)}: {err}")
    return {
        "path": str(reader.path),
        "format_version": reader.format_version,
        "blocks": len(reader.blocks),
        "bytes": reader.size,
        "bytes_checked": reader.bytes_read,
        "ok": not faults,
        "faults": faults,
        # what this format stores without a checksum: a change there cannot be seen
        "unverifiable": reader.uncovered(),
    }


def inspect(pack: str | Path) -> dict:
    """What a pack holds, from its header and block table (no KV tensor is read, torch is not
    needed)."""
    reader = PackReader(pack)
    h = reader.header
    kv = h.kv
    counts = reader.blocks.layer_totals()  # [blocks, layers] (held per head: layers x heads)
    heads = None  # held per head: [layers, heads] tokens each KV head keeps
    if kv.per_head:  # a layer's tokens: its heads' entries over its heads (one token: all heads)
        by_head = counts.reshape(len(counts), kv.layers, kv.kv_heads)
        heads = by_head.sum(axis=0)  # zeros for a pack of no blocks
        counts = by_head.sum(axis=2) / kv.kv_heads
    per_layer = counts.sum(axis=0).tolist() if len(counts) else [0] * kv.layers
    # K + V (+ their quantization scales) per token per layer, as stored
    stored = reader.stored_bytes(["blocks.k", "blocks.v", "blocks.kq", "blocks.vq"])
    as_computed = 2 * kv.kv_heads * kv.head_dim * BYTES_PER_VALUE.get(kv.dtype, 2)
    per_token = stored / max(1e-9, float(counts.sum())) if len(counts) else as_computed
    total = h.visual_tokens_total
    kept = sum(per_layer) / max(1, len(per_layer))
    spans = reader.spans_meta
    granularities = _granularities(reader, counts, per_token, total)
    views = [g for g in granularities if g in ("patch", "frame", "segment")]
    return {
        "path": str(reader.path),
        "format_version": h.format_version,
        "model": h.fingerprint.model,
        "family": h.fingerprint.family,
        "method": h.method.name,
        "budget": h.method.budget,
        "budget_tokens": h.method.budget_tokens,
        "reduce": h.method.reduce["name"] if h.method.reduce else None,
        "media": {
            "kind": h.media.kind,
            "source": h.media.source,
            "digest": h.media.digest,
            "frames": h.media.frames,
        },
        "blocks": len(reader.blocks),
        "visual_tokens_total": total,  # seen: every visual token the media gave
        # prefilled: those a token reducer let through to the language model (all without one)
        "visual_tokens_prefilled": h.stats.get("visual_tokens_prefilled", total),
        "visual_tokens_kept": round(kept, 2),  # per layer, averaged over layers
        "visual_kv_share": round(kept / max(1, total or 0), 4),
        # MuKV-style packs cut the same stream several ways: each view holds its own share of it
        "overlapping_views": views if len(views) > 1 else [],
        "prompt_tokens": spans["prefix"]["layer_counts"][0] + spans["suffix"]["layer_counts"][0],
        "bytes": reader.size,
        "kv_bytes": round(float(sum(per_layer)) * per_token),
        # bits a stored value takes: the quantized width, else the dtype's (32 for float32)
        "kv_bits": reader.quant.bits if reader.quant else 8 * BYTES_PER_VALUE[kv.dtype],
        "kv_group": reader.quant.group if reader.quant else None,
        "kv_dtype": kv.dtype,
        "kv_bytes_per_token": round(per_token, 2),  # per layer, K + V and their scales
        "kv_bytes_per_token_as_computed": as_computed,
        # held per head, a layer's tokens are its heads' mean, and each head's count is given
        "per_head": kv.per_head,
        # v13: bytes of the kept tokens as taken in (SAVEMem's late interaction reads them)
        "embeddings_bytes": reader.stored_bytes(["embeds"]),
        "layers": [
            {"index": i, "tokens_kept": _count(n)}
            | ({"heads": [int(c) for c in heads[i]]} if heads is not None else {})
            for i, n in enumerate(per_layer)
        ],
        "granularities": granularities,
        "positions": {
            "dims": h.layout.position_dims,
            "next_position": h.layout.next_position,
            "rope_deltas": h.layout.rope_deltas,
        },
        "created": h.created,
    }


def _count(n: float) -> int | float:
    return int(n) if float(n).is_integer() else round(float(n), 2)


def _granularities(reader: PackReader, counts, per_token: float, total: int | None) -> dict:
    """Per kind of block (frame, patch, segment, summary...): blocks, tokens per layer, the share
    of the stream, bytes."""
    codes = reader.blocks.codes()
    out: dict[str, dict] = {}
    for code in dict.fromkeys(codes.tolist()):
        mine = counts[codes == code]
        tokens = float(mine.sum()) / max(1, mine.shape[1])
        out[reader.blocks.kinds[code]] = {
            "blocks": int(mine.shape[0]),
            "tokens": round(tokens, 2),  # per layer, averaged over layers
            "stream_share": round(tokens / max(1, total or 0), 4),
            "bytes": round(int(mine.sum()) * per_token),
        }
    return out


def listing(folder: str | Path, check: bool = False) -> list[dict]:
    """Every *.kvpack in `folder` (not below it), by name: its model, method, media, size and
    state. "opens": its header, directory and block table passed every check made on open;
    "verified" (check: every byte read and checked, as `verify`); else the fault, in one line.
    No model, no torch (a quantized pack's `check` decodes its values, as `verify` does)."""
    where = Path(folder)
    try:
        if not where.is_dir():
            raise PackError(f"{folder} is not a folder")
        paths = sorted(where.glob("*.kvpack"))
    except OSError as err:  # a folder we may not read
        raise unreadable(folder, err) from None
    rows = []
    for path in paths:
        row: dict = {"name": path.name, "bytes": 0}
        try:  # one entry's fault is its row's state: the rest are still listed
            row["bytes"] = path.stat().st_size
            info = inspect(path)
            report = verify(path) if check else None
        except OSError as err:  # a dangling link, a link loop, a file we may not read
            rows.append({**row, "state": f"cannot be read: {err.strerror or err}"})
            continue
        except PackError as err:
            rows.append({**row, "state": str(err).replace(str(path), path.name)})
            continue
        row.update(
            model=info["model"],
            method=info["method"],
            budget=info["budget"],
            budget_tokens=info["budget_tokens"],
            media=Path(str(info["media"]["source"])).name if info["media"]["source"] else None,
            frames=info["media"]["frames"],
            format_version=info["format_version"],
        )
        if report is None:
            row["state"] = "opens"
        else:
            faults = len(report["faults"])
            row["state"] = (
                f"{faults} fault{'s' * (faults != 1)}"
                if not report["ok"]
                else f"verified as far as v{report['format_version']} can tell"
                if report["unverifiable"]
                else "verified"
            )
        rows.append(row)
    return rows
