"""ReKV's `chunk_size` (issue 72): frames retrieved in runs, as the authors' code does
(Becomebright/ReKV, kv_cache_manager.py at 63793f7): each run of chunk_size frames scores its
mean, the last run whatever is left; the best k / chunk_size runs are taken whole."""

import numpy as np
import pytest
import torch

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import AskOptions, GenerationOptions, MethodSpec
from mmkv_cli.methods.rekv import ReKVParams
from mmkv_cli.methods.retrieval import retrieve
from tests.conftest import SAMPLES
from tests.helpers import encode_pack


def _the_codes_runs(logits: torch.Tensor, topk: int, chunk: int) -> list[list[int]]:
    """The definition, per row of logits [units, blocks]: means of whole runs, then the
    remainder's mean as one more run; the best topk // chunk runs, in order, expanded to their
    blocks, those past the end dropped."""
    rest = logits.shape[1] % chunk
    means = logits[:, : logits.shape[1] - rest].reshape(logits.shape[0], -1, chunk).mean(-1)
    if rest:
        means = torch.cat([means, logits[:, -rest:].mean(-1, keepdim=True)], dim=1)
    runs = means.topk(topk // chunk, dim=1).indices.sort(dim=1)[0]
    blocks = (runs[:, :, None] * chunk + torch.arange(chunk)).reshape(logits.shape[0], -1)
    return [[i for i in row if i < logits.shape[1]] for row in blocks.tolist()]


@pytest.mark.parametrize(("blocks", "k", "chunk"), [(10, 4, 4), (11, 6, 3), (64, 16, 4), (9, 8, 2)])
def test_runs_are_chosen_as_the_code_chooses_them(blocks, k, chunk):
    torch.manual_seed(blocks)
    scores = torch.randn(3, blocks)  # 3 layers, each its own choice
    reps = torch.zeros(blocks, 3, 4)
    picks = retrieve(scores, reps, ["frame"] * blocks, {"frame": k}, {}, 0, chunk=chunk)
    for layer, pick in enumerate(picks):
        assert (
            sorted(pick.index.tolist()) == _the_codes_runs(scores[layer : layer + 1], k, chunk)[0]
        )
        assert np.allclose(pick.score, scores[layer, pick.index].numpy())
        assert set(pick.granularity) == {"frame"}


def test_a_short_last_run_is_taken_with_what_it_has():
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0]])  # the run of one block wins
    (pick,) = retrieve(scores, torch.zeros(5, 1, 2), ["frame"] * 5, {"frame": 2}, {}, 0, chunk=2)
    assert pick.index.tolist() == [4] and pick.reranked.tolist() == [5.0]


def test_chunk_size_one_is_frame_by_frame_and_k_must_be_a_multiple():
    torch.manual_seed(1)
    scores = torch.randn(2, 20)
    reps = torch.zeros(20, 2, 4)
    one = retrieve(scores, reps, ["frame"] * 20, {"frame": 5}, {}, 0, chunk=1)
    plain = retrieve(scores, reps, ["frame"] * 20, {"frame": 5}, {}, 0)
    assert all(np.array_equal(a.index, b.index) for a, b in zip(one, plain))
    assert ReKVParams().chunk_size == 1  # the code's default
    with pytest.raises(UsageError, match="multiple of chunk_size"):
        ReKVParams(k=6, chunk_size=4)


@pytest.mark.parametrize(
    "params",
    [{"retrieve": "in_forward"}, {"retrieve": "two_pass", "layers": "last"}],
)
def test_a_pack_answers_from_whole_runs_of_frames(tmp_path, backbones, params):
    """Every layer's picks are whole runs, so their union is too; one choice for every layer
    (layers: last) is k / chunk_size = 2 runs."""
    from mmkv_cli import api
    from mmkv_cli.pack import PackReader

    pack = tmp_path / "rekv.kvpack"
    spec = MethodSpec("rekv", {"k": 4, "chunk_size": 2, **params})
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", spec)
    blocks = len(PackReader(pack).blocks)
    options = AskOptions(generation=GenerationOptions(max_new_tokens=2), explain=True)
    answer = api.PackSession(pack, shared=True).ask("which shape appeared first ?", options)
    frames = sorted(int(name[1:]) for name in answer.blocks_used)
    runs = {frame // 2 for frame in frames}
    assert blocks > 4 and (len(runs) == 2 or params["retrieve"] == "in_forward")
    assert frames == [f for run in sorted(runs) for f in (2 * run, 2 * run + 1) if f < blocks]
