"""A checkpoint's running cache as tensors: stream indices and pristine marks as runs, pieces
by stream index, and what a resume rebuilds from them."""

import pytest
import torch
from transformers import DynamicCache

from mmkv_cli.core.errors import PackError
from mmkv_cli.encode.saved_state import (
    flag_runs,
    from_flag_runs,
    from_index_runs,
    index_runs,
    restore_running_cache,
    running_cache_tensors,
)
from mmkv_cli.methods.running_cache import RunningCache


@pytest.mark.parametrize(
    "index",
    [[], [5], list(range(100)), [0, 1, 2, 7, 8, 20, 3, 4], [9, 8, 7]],
)
def test_stream_indices_come_back_from_their_runs(index):
    index = torch.tensor(index, dtype=torch.long)
    runs = index_runs(index)
    assert torch.equal(from_index_runs(runs), index)
    if len(index) == 100:
        assert runs.tolist() == [[0, 100]]  # an hour of `full`: one run


@pytest.mark.parametrize("flags", [[], [True], [False], [True, True, False, True], [False] * 9])
def test_pristine_marks_come_back_from_their_runs(flags):
    flags = torch.tensor(flags, dtype=torch.bool)
    assert torch.equal(from_flag_runs(flag_runs(flags)), flags)


def test_bad_runs_are_refused():
    with pytest.raises(PackError, match="corrupted"):
        from_index_runs(torch.tensor([[0, -3]]))
    with pytest.raises(PackError, match="corrupted"):
        from_flag_runs(torch.tensor([2, -1]))


def running_cache(layers=2, prompt=3, heads=2, dim=4):
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(torch.randn(1, heads, prompt, dim), torch.randn(1, heads, prompt, dim), layer)
    return RunningCache(cache, prompt, 1)


def stream(running, start, n, heads=2, dim=4):
    for entry in running.cache.layers:
        entry.keys = torch.cat([entry.keys, torch.randn(1, heads, n, dim)], dim=2)
        entry.values = torch.cat([entry.values, torch.randn(1, heads, n, dim)], dim=2)
    running.appended(torch.arange(start, start + n), torch.arange(start, start + n).view(1, n))


def test_a_running_cache_comes_back_from_its_pieces_after_evictions_and_rewrites(monkeypatch):
    """Sealed pieces keep rows the policy evicts later; the rebuild takes only the rows held,
    rewritten entries come from the head, and the result is the same cache, entry for entry."""
    running = running_cache()
    stream(running, 0, 4)
    _, first = running_cache_tensors(running, [4])  # piece 0: stream indices 0-3
    stream(running, 4, 6)
    _, second = running_cache_tensors(running, [4, 10])  # piece 1: 4-9
    assert set(first) < set(second)  # a piece keeps its name: it is written once
    assert all(first[n].nbytes == second[n].nbytes for n in first)
    written = {name: s.make() for name, s in second.items()}
    assert written["cache.0.stream.index.1"].tolist() == list(range(4, 10))
    running.retain(0, torch.tensor([1, 2, 5, 8, 9]))  # scattered evictions in layer 0
    running.retain(1, torch.arange(3, 10))  # a sliding window in layer 1
    stream(running, 10, 3)
    running.replace(1, positions=running.positions[1] + 100)  # layer 1 moved: no longer pristine
    live, sealed = running_cache_tensors(running, [4, 10, 13])
    assert sealed["cache.0.stream.k.1"].nbytes < second["cache.0.stream.k.1"].nbytes  # stale rows
    assert set(sealed) <= set(written) | {n for n in sealed if n.endswith(".2")}
    assert not [n for n in sealed if n.startswith("cache.1.stream")]  # all loose now
    assert live["cache.0.loose.k"].shape[1] == 0  # every pristine entry is in a piece
    tensors = dict(live) | written | {n: s.make() for n, s in sealed.items() if n not in written}
    back = running_cache(prompt=3)
    assert restore_running_cache(back, tensors) == [4, 10, 13]
    for layer in range(2):
        assert torch.equal(back.cache.layers[layer].keys, running.cache.layers[layer].keys)
        assert torch.equal(back.cache.layers[layer].values, running.cache.layers[layer].values)
        assert torch.equal(back.index[layer], running.index[layer])
        assert torch.equal(back.positions[layer], running.positions[layer])
        assert torch.equal(back.pristine[layer], running.pristine[layer])
    assert back.streamed == 13
    assert not [n for n in tensors if n.startswith("cache.")]  # every piece taken, stale ones too


def test_pieces_that_do_not_hold_what_the_head_says_are_refused():
    """A piece missing a served entry, or cuts that do not rise to where the stream is, are
    refused as a corrupted checkpoint (never a half-rebuilt cache)."""
    running = running_cache()
    stream(running, 0, 6)
    live, sealed = running_cache_tensors(running, [3, 6])
    tensors = dict(live) | {n: s.make() for n, s in sealed.items()}
    short = dict(tensors)
    short["cache.1.stream.index.1"] = torch.tensor([3, 5, 6])  # 4 is not in its piece
    with pytest.raises(PackError, match="cache.1's piece 1 does not fit"):
        restore_running_cache(running_cache(), short)
    for cuts in ([3, 5], [3, 3, 6], [], [0, 6]):
        bad = dict(tensors) | {"cache.cuts": torch.tensor(cuts, dtype=torch.long)}
        with pytest.raises(PackError, match="bad stream cuts"):
            restore_running_cache(running_cache(), bad)
