"""A pack rewritten in place under an open reader (`cp new.kvpack served.kvpack`): every read gives
the bytes it opened or one clear error, never a dead process (a mapped page past the new end of the
file is a SIGBUS)."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader, Span, write_pack
from tests.helpers import pack_header


def _pack(path, blocks: int, tokens: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def span(name, n, granularity=None):
        return Span(
            name=name,
            keys=[torch.randn(4, n, 64, generator=g) for _ in range(2)],
            values=[torch.randn(4, n, 64, generator=g) for _ in range(2)],
            positions=[torch.arange(n)[None] for _ in range(2)],
            granularity=granularity,
            steps=(0, 1) if granularity else None,
        )

    body = [span(f"b{i}", tokens, "frame") for i in range(blocks)]
    write_pack(
        path,
        pack_header(2, heads=4, dim=64),
        span("prefix", 2),
        body,
        span("suffix", 1),
        force=True,
    )


READER = """
import sys, time
from mmkv_cli.core.errors import PackError
from mmkv_cli.pack import PackReader

def reopen():  # as serve does when a pack changed; a pack caught mid-copy is refused whole
    while True:
        try:
            return PackReader(path)
        except PackError:
            time.sleep(0.001)

path, stop = sys.argv[1], time.time() + float(sys.argv[2])
reader, reads, refused = reopen(), 0, 0
while time.time() < stop:
    try:
        reader.gather([b["name"] for b in reader.blocks])
        reads += 1
    except PackError as err:
        refused += 1
        reader = reopen()
print(reads, refused)
"""


def test_a_pack_rewritten_in_place_under_a_reader_never_kills_it(tmp_path):
    big, small, served = tmp_path / "big.kvpack", tmp_path / "small.kvpack", tmp_path / "s.kvpack"
    _pack(big, blocks=16, tokens=64, seed=1)  # about 1 MiB of blocks: many pages past small's end
    _pack(small, blocks=2, tokens=8, seed=2)
    shutil.copyfile(big, served)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(READER), str(served), "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    copies = 0
    while reader.poll() is None:
        shutil.copyfile(small if copies % 2 else big, served)  # truncates, then writes: as cp does
        copies += 1
        time.sleep(0.002)
    out, err = reader.communicate()
    assert reader.returncode == 0, f"reader died ({reader.returncode}): {err[-500:]}"
    reads, refused = map(int, out.split())
    assert copies > 50 and reads + refused > 10


def test_bytes_rewritten_in_place_after_a_check_are_not_served(tmp_path):
    """Same size, same mtime: a block already checked is not read again unseen."""
    path = tmp_path / "a.kvpack"
    _pack(path, blocks=2, tokens=8, seed=1)
    reader = PackReader(path)
    names = [b["name"] for b in reader.blocks]
    reader.gather(names)  # checked once: later reads of these blocks skip their checksum
    before = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(before.st_size - 64)
        fh.write(bytes(64))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(PackError, match="changed while it was being read"):
        reader.gather(names)
