"""What a batch encodes: a folder, a glob (local or a bucket's), or a JSONL/CSV manifest with a
`media` column and optional per-row encode options. Every row is checked before any work."""

from __future__ import annotations

import csv
import glob as globlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from mmkv_cli.core.errors import UsageError
from mmkv_cli.pack import URL, filesystem, is_url, local_path, read_text

MEDIA_SUFFIXES = {".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".pdf"}
# per-row options a manifest may set, and the type each must have
ROW_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "method": str,
    "budget": (int, float),
    "budget_tokens": int,
    "fps": (int, float),
    "max_frames": int,
    "kv_bits": (int, float),
    "kv_group": int,
    "guidance_prompt": str,
    "reduce": str,
}
COLUMNS = {"media", "id", *ROW_OPTIONS}
MAX_ROWS = 1_000_000


@dataclass(frozen=True)
class BatchItem:
    media: str  # a local path or a URL
    id: str | None = None  # the manifest's own name for the row, echoed in the ledger
    options: dict = field(default_factory=dict)  # per-row encode options (ROW_OPTIONS)
    where: str = ""  # the manifest row it came from, for error lines

    @property
    def key(self) -> str:
        """The item's identity in the ledger: its media and its own options."""
        return json.dumps([self.media, sorted(self.options.items())], default=str)


def read_manifest(spec: str) -> list[BatchItem]:
    """The items `spec` names (see the module doc), in a stable order, duplicates refused."""
    lower = spec.lower()
    if lower.endswith((".jsonl", ".csv")):
        items = _rows(spec)
    elif is_url(spec):
        items = [BatchItem(url) for url in _remote_media(spec)]
    else:
        path = local_path(spec)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in MEDIA_SUFFIXES)
        else:
            found = sorted(Path(p) for p in globlib.glob(str(path)))
            found = [p for p in found if p.is_file() and p.suffix.lower() in MEDIA_SUFFIXES]
        items = [BatchItem(str(p)) for p in found]
    if not items:
        raise UsageError(f"{spec} names no media (videos or PDFs) to encode")
    seen: dict[str, str] = {}
    for item in items:
        if item.key in seen:
            raise UsageError(
                f"{item.where or item.media}: the same media and options as {seen[item.key]}"
            )
        seen[item.key] = item.where or item.media
    return items


def _remote_media(spec: str) -> list[str]:
    """Media objects under a bucket prefix, or matching a glob there."""
    fs, path = filesystem(spec)
    scheme = URL.match(spec).group(1)
    try:
        found = fs.glob(path) if any(c in path for c in "*?[") else fs.find(path)
    except Exception as err:
        raise UsageError(f"cannot list {spec}: {str(err).splitlines()[0][:200]}") from None
    return [f"{scheme}://{p}" for p in sorted(found) if Path(p).suffix.lower() in MEDIA_SUFFIXES]


def _rows(spec: str) -> list[BatchItem]:
    text = read_text(spec) if is_url(spec) else _read_local(local_path(spec))
    if text is None:
        raise UsageError(f"no such manifest: {spec}")
    base = spec.rsplit("/", 1)[0] if is_url(spec) else str(local_path(spec).parent)
    if spec.lower().endswith(".csv"):
        reader = csv.DictReader(io.StringIO(text))
        unknown = sorted(set(reader.fieldnames or []) - COLUMNS)
        if "media" not in (reader.fieldnames or []) or unknown:
            raise UsageError(
                f"{spec}: columns must include media and come from {sorted(COLUMNS)} "
                f"(unknown: {', '.join(unknown) or 'none'})"
            )
        records = [(f"{spec}:{n}", _typed(row, f"{spec}:{n}")) for n, row in enumerate(reader, 2)]
    else:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{spec}:{n}: not JSON ({err.msg})") from None
            except RecursionError:
                raise UsageError(f"{spec}:{n}: JSON nested too deep") from None
            if not isinstance(row, dict):
                raise UsageError(f"{spec}:{n}: each line must be a JSON object")
            records.append((f"{spec}:{n}", row))
    if len(records) > MAX_ROWS:
        raise UsageError(f"{spec} has more than {MAX_ROWS:,} rows")
    return [_item(row, where, base) for where, row in records]


def _read_local(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8-sig")  # a byte-order mark is not text
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {path}: {err}") from None


def _typed(row: dict, where: str) -> dict:
    """A CSV row's cells as the types JSON would give them (empty cells: unset)."""
    out = {}
    for key, cell in row.items():
        if cell is None or cell == "":
            continue
        kind = ROW_OPTIONS.get(key)
        try:
            if kind is int:
                out[key] = int(cell)
            elif kind == (int, float):
                out[key] = float(cell)
            else:
                out[key] = cell
        except ValueError:
            raise UsageError(f"{where}: {key} must be a number, not {cell!r}") from None
    return out


def _item(row: dict, where: str, base: str) -> BatchItem:
    unknown = sorted(set(row) - COLUMNS)
    if unknown:
        raise UsageError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(COLUMNS))})"
        )
    media = row.get("media")
    if not isinstance(media, str) or not media.strip():
        raise UsageError(f"{where}: media must be a path or URL")
    ident = row.get("id")
    if ident is not None and not isinstance(ident, (str, int)):
        raise UsageError(f"{where}: id must be a string or an integer")
    options = {}
    for key, kind in ROW_OPTIONS.items():
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise UsageError(f"{where}: {key} has the wrong type ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{where}: {key} must be finite")
        options[key] = value
    if not is_url(media) and not Path(media).is_absolute():
        media = f"{base}/{media}" if is_url(base) else str(Path(base) / media)
    local = None if is_url(media) else Path(media)
    if local is not None and local.exists() and not (local.is_file() or local.is_dir()):
        # a device or a FIFO: hashing /dev/zero would never end
        raise UsageError(f"{where}: {media} is not a regular file or folder")
    return BatchItem(media, None if ident is None else str(ident), options, where)
