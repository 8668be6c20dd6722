"""Where `serve` finds packs by name: a local folder, or a bucket prefix (s3://b/packs/). A name is
a plain file name, never a way out of the place."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.names import name_problem
from mmkv_cli.pack import filesystem, is_url, local_path


def _stem(name: str) -> str:
    stem = name[: -len(".kvpack")] if name.endswith(".kvpack") else name
    if name_problem(stem) is not None:
        raise LookupError(f"no pack named '{name[:128]}'")
    return stem


class Shelf(Protocol):
    where: str

    def locate(self, name: str) -> tuple[str | Path, tuple]:
        """(the pack called `name`, a version key that changes when it is replaced); LookupError
        when there is none."""

    def names(self) -> list[str]: ...

    def hide(self, text: str) -> str:
        """`text` (an error, a listing) with the server's own location of the packs taken out:
        a client knows a pack by its name."""


class FolderShelf:
    def __init__(self, folder: Path):
        if not folder.is_dir():
            raise UsageError(f"--packs: no such folder: {folder}")
        self.folder = folder.resolve()
        self.where = str(folder)

    def locate(self, name: str) -> tuple[Path, tuple]:
        path = (self.folder / f"{_stem(name)}.kvpack").resolve()
        if path.parent != self.folder or not path.is_file():
            raise LookupError(f"no pack named '{name}'")
        stat = path.stat()
        return path, (stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_size)

    def hide(self, text: str) -> str:
        for place in (str(self.folder), self.where):
            text = text.replace(place.rstrip("/") + "/", "")
        return text

    def names(self) -> list[str]:
        out = []
        for path in sorted(self.folder.glob("*.kvpack")):
            try:
                self.locate(path.stem)
            except LookupError:
                continue  # a link out of the folder, or an odd name
            out.append(path.stem)
        return out


class BucketShelf:
    """Packs under an object-store prefix, listed and located fresh on every call (a batch may be
    adding packs while they are served)."""

    def __init__(self, url: str):
        self.where = url.rstrip("/")
        self.fs, self.prefix = filesystem(self.where)
        self.scheme = url.split("://", 1)[0]
        try:
            self.fs.ls(self.prefix, detail=False)
        except FileNotFoundError:
            raise UsageError(f"--packs: nothing at {url}") from None
        except Exception as err:
            raise UsageError(
                f"--packs: cannot list {url}: {str(err).splitlines()[0][:200]}"
            ) from None

    def locate(self, name: str) -> tuple[str, tuple]:
        key = f"{self.prefix}/{_stem(name)}.kvpack"
        self.fs.invalidate_cache(key)
        try:
            info = self.fs.info(key)
        except FileNotFoundError:
            raise LookupError(f"no pack named '{name}'") from None
        except Exception as err:
            raise LookupError(f"pack '{name}' cannot be reached: {str(err)[:200]}") from None
        version = (info.get("ETag") or info.get("etag") or info.get("mtime"), info.get("size"))
        return f"{self.scheme}://{key}", version

    def hide(self, text: str) -> str:
        return text.replace(f"{self.scheme}://{self.prefix}/", "").replace(self.where + "/", "")

    def names(self) -> list[str]:
        self.fs.invalidate_cache(self.prefix)
        found = self.fs.glob(f"{self.prefix}/*.kvpack")
        stems = (Path(p).stem for p in sorted(found))
        return [s for s in stems if name_problem(s) is None]


def shelf(where: str | Path) -> FolderShelf | BucketShelf:
    return BucketShelf(str(where)) if is_url(where) else FolderShelf(local_path(where))
