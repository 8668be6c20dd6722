"""A safetensors file opened once: its directory checked, each tensor's bytes read whole or
viewed through one memory map of the descriptor (never the path: a file replaced under the reader
leaves it reading the one it opened)."""

from __future__ import annotations

import os

import numpy as np

from mmkv_cli.errors import PackError
from mmkv_cli.lazy import torch
from mmkv_cli.pack.integrity import read_directory
from mmkv_cli.pack.source import PackFile

# safetensors dtype -> the numpy dtype its bytes are read as, and the torch dtype they are viewed as
# after
_DTYPES = {
    "F64": (np.float64, "float64"),
    "F32": (np.float32, "float32"),
    "F16": (np.float16, "float16"),
    "BF16": (np.uint16, "bfloat16"),
    "I64": (np.int64, "int64"),
    "I32": (np.int32, "int32"),
    "U8": (np.uint8, "uint8"),
}


class StoredTensors:
    """The tensors of an open pack file, by name."""

    def __init__(self, source: PackFile, path):
        self.source, self.path = source, path
        self._file = source.file
        self.size = source.size  # as opened: a file that changes size under a read is refused
        raw, self.data_start = read_directory(self._file, path, source.ensure)
        self.metadata = raw.get("__metadata__")
        self.entries = {k: v for k, v in raw.items() if k != "__metadata__"}
        self._map: np.memmap | None = None  # the whole file, mapped on the first view
        self._views: dict[str, tuple[np.ndarray, str]] = {}  # name -> (view, torch dtype name)
        self.small: dict[str, np.ndarray] = {}  # small tensors' bytes read (and digested) on open
        self.bytes_read = 0

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s stored bytes, read whole."""
        start, stop = (self.data_start + o for o in self.entries[name]["data_offsets"])
        self.source.ensure([(start, stop)])
        data = os.pread(self._file.fileno(), stop - start, start)
        self.bytes_read += len(data)
        return np.frombuffer(bytearray(data), dtype=np.uint8)  # writable, as a numpy copy is

    def stored_bytes(self, names: list[str]) -> int:
        """Bytes the tensors `names` take in the file (0 for those it does not hold)."""
        spans = [self.entries[n]["data_offsets"] for n in names if n in self.entries]
        return sum(stop - start for start, stop in spans)

    def still_whole(self) -> None:
        """Reading a mapped file that shrank would kill the process (SIGBUS): a pack cut short in
        place while it is read is one clear error instead."""
        if os.fstat(self._file.fileno()).st_size != self.size:
            raise PackError(f"{self.path} changed while it was being read")

    def array(self, name: str) -> np.ndarray:
        """Tensor `name` read whole into memory, as numpy (no torch needed)."""
        if name in self.small:  # read (and digested) on open
            entry = self.entries[name]
            np_dtype = _DTYPES[entry["dtype"]][0]
            return self.small.pop(name).view(np_dtype).reshape(entry["shape"])
        view, _ = self.view(name)
        self.source.ensure([self.tensor_range(name)])
        out = np.array(view)
        self.bytes_read += out.nbytes
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` read whole into memory, as torch."""
        _, dtype = self.view(name)
        return torch.from_numpy(self.array(name)).view(getattr(torch, dtype))

    def view(self, name: str) -> tuple[np.ndarray, str]:
        """Tensor `name` as a shaped view of the memory-mapped file (nothing read until it is
        indexed)."""
        if name not in self._views:
            entry = self.entries.get(name)
            if entry is None or entry.get("dtype") not in _DTYPES:
                raise PackError(
                    f"{self.path} is corrupted: tensor {name} missing or of an unknown type"
                )
            self.still_whole()
            if self._map is None:  # the descriptor opened, not the path: replacement-proof
                self._map = np.memmap(self._file, dtype=np.uint8, mode="r")
            start, stop = (self.data_start + o for o in entry["data_offsets"])
            np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
            # a plain array over the map: memmap's own indexing is slow
            flat = np.asarray(self._map[start:stop])
            try:
                self._views[name] = (flat.view(np_dtype).reshape(entry["shape"]), torch_dtype)
            except (ValueError, TypeError) as err:
                raise PackError(f"{self.path} is corrupted: tensor {name} has a bad shape") from err
        return self._views[name]

    def tensor_range(self, name: str) -> tuple[int, int]:
        """Tensor `name`'s absolute byte range in the file."""
        start, stop = self.entries[name]["data_offsets"]
        return self.data_start + start, self.data_start + stop
