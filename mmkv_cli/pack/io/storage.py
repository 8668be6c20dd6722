"""Packs and media on object storage, through fsspec: which strings are URLs, ranged reads, and
publishing a finished file so that its final name only ever shows it whole.

Credentials and endpoints come from the environment, as the filesystems read them (s3fs: the
AWS_* variables and ~/.aws, AWS_ENDPOINT_URL_S3 for an S3-compatible server; fsspec's
FSSPEC_<PROTOCOL>_<OPTION> variables for anything else). `file://` URLs are plain local paths.
"""

from __future__ import annotations

import bisect
import os
import re
from contextlib import contextmanager
from pathlib import Path

from mmkv_cli.core import logs
from mmkv_cli.core.errors import OutputExistsError, PackError, StorageError, output_exists

LOG = logs.get("mmkv_cli.pack.storage")  # its name before the rooms: users filter by it

URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# Stores where an upload becomes visible only once it is complete (a PUT, a completed multipart or
# resumable upload, a committed block list): the final key never shows part of a pack.
WHOLE_ON_UPLOAD = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"}
# Ranges closer than this are fetched as one request: a round trip costs more than 64 KiB.
MERGE_GAP = 64 << 10
# A request asks for at most this many bytes: a retrieved context or a `verify` of an hour's pack
# at 7B wants GBs, fetched as many ranged GETs at once (one connection runs far below the store's
# rate) rather than one
FETCH_BYTES = 16 << 20
# Requests in flight together ask for at most this many bytes: what a fetch holds in memory
# before it is written to the mirror
FETCH_BATCH_BYTES = 256 << 20
# what to install for a scheme's fsspec driver
DRIVERS = {"s3": "'mmkv[s3]'", "s3a": "'mmkv[s3]'", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}


def is_url(target: str | Path) -> bool:
    """A remote location (s3://, gs://, memory://, ...): not a local path, nor file://."""
    found = URL.match(str(target))
    return bool(found) and found.group(1).lower() != "file"


def local_path(target: str | Path) -> Path:
    """A local path, from a path or a file:// URL."""
    text = str(target)
    return Path(text[len("file://") :] if text.lower().startswith("file://") else text)


def filesystem(url: str):
    """(the fsspec filesystem for `url`, the path inside it). Missing drivers are one line."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        scheme = URL.match(url).group(1).lower()
        driver = DRIVERS.get(scheme, "the fsspec driver for it")
        raise StorageError(f"{scheme}:// needs its fsspec driver: pip install {driver}") from None
    except (ValueError, OSError) as err:
        raise StorageError(f"cannot open {url}: {_reason(err)}") from None


def _reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


def exists(url: str) -> bool:
    fs, key = filesystem(url)
    try:
        return bool(fs.exists(key))
    except Exception as err:  # the driver's own errors (botocore, aiohttp) are not OSErrors
        raise StorageError(f"cannot reach {url}: {_reason(err)}") from None


def check_writable_url(url: str, force: bool) -> None:
    """Fail before any work when `url` exists (without --force) or its bucket does not."""
    fs, key = filesystem(url)
    try:
        if fs.exists(key) and not force:
            raise output_exists(url)
        bucket = key.split("/", 1)[0]
        buckets = set(_protocols(fs)) & (WHOLE_ON_UPLOAD - {"memory"})  # memory:// has none
        if buckets and not fs.exists(bucket):
            raise StorageError(f"cannot write {url}: no bucket {bucket}")
    except (OutputExistsError, StorageError):
        raise
    except Exception as err:
        raise StorageError(f"cannot reach {url}: {_reason(err)}") from None


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def publish(local: Path, url: str) -> None:
    """Upload the finished file `local` to `url`. On stores where an upload shows only when whole,
    straight to the final key; elsewhere to a partial name, then renamed."""
    fs, key = filesystem(url)
    try:
        if set(_protocols(fs)) & WHOLE_ON_UPLOAD:
            fs.put_file(str(local), key)
            return
        parent, _, name = key.rpartition("/")
        partial = f"{parent}/.{name}.{os.getpid()}.mmkv-partial"
        fs.put_file(str(local), partial)
        fs.mv(partial, key)
    except Exception as err:
        raise StorageError(f"cannot write {url}: {_reason(err)}") from None


def write_text(url: str, text: str) -> None:
    """A small object (a ledger) written whole."""
    fs, key = filesystem(url)
    try:
        fs.pipe_file(key, text.encode())
    except Exception as err:
        raise StorageError(f"cannot write {url}: {_reason(err)}") from None


def read_text(url: str) -> str | None:
    """A small object's text, or None when there is none."""
    fs, key = filesystem(url)
    try:
        return fs.cat_file(key).decode("utf-8-sig")  # a byte-order mark is not text
    except FileNotFoundError:
        return None
    except Exception as err:
        raise StorageError(f"cannot read {url}: {_reason(err)}") from None


def download(url: str, into: Path) -> None:
    fs, key = filesystem(url)
    try:
        fs.get_file(key, str(into))
    except FileNotFoundError:
        raise StorageError(f"no such object: {url}") from None
    except Exception as err:
        raise StorageError(f"cannot read {url}: {_reason(err)}") from None


class Intervals:
    """Byte ranges already held, kept merged and sorted: what a mirror need not fetch again."""

    def __init__(self):
        self.starts: list[int] = []
        self.stops: list[int] = []

    def missing(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of [start, stop) not held."""
        out, at = [], start
        i = bisect.bisect_right(self.stops, start)
        while at < stop and i < len(self.starts):
            if self.starts[i] >= stop:
                break
            if self.starts[i] > at:
                out.append((at, self.starts[i]))
            at = max(at, self.stops[i])
            i += 1
        if at < stop:
            out.append((at, stop))
        return out

    def add(self, start: int, stop: int) -> None:
        lo = bisect.bisect_left(self.stops, start)
        hi = bisect.bisect_right(self.starts, stop)
        if lo < hi:
            start, stop = min(start, self.starts[lo]), max(stop, self.stops[hi - 1])
        self.starts[lo:hi], self.stops[lo:hi] = [start], [stop]


def pieces(ranges: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """`ranges` cut into ranges of at most `most` bytes."""
    return [(a, min(stop, a + most)) for start, stop in ranges for a in range(start, stop, most)]


def batches(ranges: list[tuple[int, int]], most: int) -> list[list[tuple[int, int]]]:
    """`ranges` in order, in runs of at most `most` bytes together (a range larger alone)."""
    out: list[list[tuple[int, int]]] = []
    held = most
    for start, stop in ranges:
        if held + stop - start > most:
            out.append([])
            held = 0
        out[-1].append((start, stop))
        held += stop - start
    return out


def merged(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ranges with those less than `gap` apart joined."""
    out: list[list[int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], stop)
        else:
            out.append([start, stop])
    return [(a, b) for a, b in out]


class RemoteFile:
    """An object read by byte ranges into a sparse local mirror: an unlinked temporary file of the
    object's size, so the pack reader reads it by descriptor as it reads a local pack, and only
    the ranges asked for ever cross the network (and take disk)."""

    def __init__(self, url: str):
        self.url = url
        self._fs, self._key = filesystem(url)
        try:
            info = self._fs.info(self._key)
        except FileNotFoundError:
            raise PackError(f"no such pack: {url}") from None
        except Exception as err:
            raise StorageError(f"cannot reach {url}: {_reason(err)}") from None
        if info.get("type") == "directory" or not isinstance(info.get("size"), int):
            raise PackError(f"no such pack: {url}")
        self.size = info["size"]
        # the version every range is read from: an object replaced under the reader is one clear
        # error at its next read, never blocks from two versions
        self.etag = info.get("ETag") or info.get("etag")
        self.version = info.get("VersionId") or info.get("version_id")
        import tempfile

        self.file = tempfile.TemporaryFile(prefix="mmkv-mirror-")  # noqa: SIM115 (held open)
        os.ftruncate(self.file.fileno(), self.size)  # sparse: no disk until bytes arrive
        self._held = Intervals()
        self.local = False
        self.fetched = 0  # bytes transferred, merged gaps included
        self.requests = 0

    def ensure(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch whatever of `ranges` (absolute [start, stop) byte ranges) is not held yet: in
        requests of at most FETCH_BYTES, FETCH_BATCH_BYTES of them at a time, each written to
        the mirror before the next batch is asked for."""
        wanted = [m for a, b in ranges for m in self._held.missing(max(0, a), min(b, self.size))]
        wanted = merged(wanted, MERGE_GAP)
        if not wanted:
            return
        for batch in batches(pieces(wanted, FETCH_BYTES), FETCH_BATCH_BYTES):
            try:
                parts = self._fetch(batch)
            except Exception as err:
                raise self._failure(err) from None
            for (start, stop), data in zip(batch, parts):
                if isinstance(data, BaseException):
                    raise self._failure(data)
                if len(data) != stop - start:
                    raise PackError(f"{self.url} changed while it was being read")
                self._write(data, start)
                self._held.add(start, stop)
            self.fetched += sum(b - a for a, b in batch)
            self.requests += len(batch)

    def _write(self, data: bytes, start: int) -> None:
        """`data` into the mirror at `start`, whole: one pwrite writes at most 2 GiB - 4 KiB on
        Linux, and a full disk is one line."""
        view, fd = memoryview(data), self.file.fileno()
        while len(view):
            try:
                written = os.pwrite(fd, view, start)
            except OSError as err:
                raise StorageError(
                    f"cannot hold {self.url}'s bytes in the temporary folder: {err.strerror or err}"
                ) from None
            if written <= 0:
                raise StorageError(f"cannot hold {self.url}'s bytes in the temporary folder")
            view, start = view[written:], start + written

    def _fetch(self, wanted: list[tuple[int, int]]) -> list:
        """The bytes of `wanted`: on S3, each range asked of the version opened (If-Match its
        ETag, or its VersionId); elsewhere, read and then checked against the ETag opened."""
        starts, stops = [a for a, _ in wanted], [b for _, b in wanted]
        if "s3" in _protocols(self._fs) and (self.etag or self.version):
            from fsspec.asyn import sync

            return sync(self._fs.loop, self._pinned_s3, wanted)
        parts = self._fs.cat_ranges([self._key] * len(wanted), starts, stops)
        if self.etag:
            now = self._fs.info(self._key, refresh=True)
            if (now.get("ETag") or now.get("etag")) != self.etag:
                raise PackError(f"{self.url} changed while it was being read")
        return parts

    async def _pinned_s3(self, wanted: list[tuple[int, int]]) -> list:
        import asyncio

        bucket, key, _ = self._fs.split_path(self._key)
        pin = {"VersionId": self.version} if self.version else {"IfMatch": self.etag}

        async def one(start: int, stop: int) -> bytes:
            got = await self._fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **pin
            )
            async with got["Body"] as body:
                return await body.read()

        return await asyncio.gather(*(one(a, b) for a, b in wanted), return_exceptions=True)

    def _failure(self, err: BaseException) -> Exception:
        if isinstance(err, PackError):
            return err
        text = f"{type(err).__name__} {err}"
        if any(m in text for m in ("PreconditionFailed", "pre-conditions", "NoSuchVersion")):
            return PackError(f"{self.url} changed while it was being read (it was replaced)")
        return StorageError(f"cannot read {self.url}: {_reason(err)}")

    def unchanged(self) -> bool:
        # the mirror is this reader's own, filled from the version opened
        return True

    def close(self) -> None:
        self.file.close()


@contextmanager
def staged_upload(url: str, force: bool):
    """The local path to write a file bound for `url`; published there once the body finishes
    (nothing is uploaded when it raises). Checked first, so a bad URL fails before any work."""
    import tempfile

    check_writable_url(url, force)
    with tempfile.TemporaryDirectory(prefix="mmkv-upload-") as folder:
        local = Path(folder) / (url.rstrip("/").rsplit("/", 1)[-1] or "pack.kvpack")
        yield local
        LOG.info("publishing %s (%d bytes)", url, local.stat().st_size)
        publish(local, url)


@contextmanager
def local_copy(url: str):
    """A remote media object downloaded to a temporary file of the same name (its extension says
    what it is), removed afterwards."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mmkv-media-") as folder:
        local = Path(folder) / (url.rstrip("/").rsplit("/", 1)[-1] or "media")
        LOG.info("downloading %s", url)
        download(url, local)
        yield local
