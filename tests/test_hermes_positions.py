"""HERMES places what streams in after a compression as its authors' code does (issue 72): each
layer's next chunk starts one past that layer's own furthest position
(`_get_next_start_pos_per_layer` in llavaov_hermes.py, the global offset in qwenvl_hermes.py), not
at one position for every layer.
mmkv runs one forward for all layers, so it moves a layer as a whole (prompt, kept tokens and
summaries, keys re-rotated) to meet the stream: RoPE attention depends on position differences
only, so every layer attends exactly as in the code's per-layer placement. Checked here against
RoPE written out in float64."""

import pytest
import torch
from transformers import DynamicCache

from mmkv_cli.encode.encoder import encode_media
from mmkv_cli.media import load_media
from mmkv_cli.methods import Budget, EncodeContext
from mmkv_cli.methods.hermes import HermesMemory, HermesParams
from mmkv_cli.methods.running_cache import RunningCache, StreamState
from tests.helpers import choose

D = 8
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rope(x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """x [n, D] rotated to `positions`, written out: pairs (i, i + D/2) turned by p * inv_freq."""
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * INV_FREQ[None]
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    half = D // 2
    turned = torch.cat([-x[:, half:], x[:, :half]], dim=-1)
    return x * cos + turned * sin


def two_layers(raw_prompt, raw_visual):
    """A shallow and a deep layer, each holding a 2-token prompt at 0, 1 and six visual tokens at
    2..7 (keys stored after RoPE, values twice the raw keys); the stream goes on at 8."""
    cache = DynamicCache()
    keys = rope(torch.cat([raw_prompt, raw_visual]), list(range(8))).float()
    for layer in range(2):
        cache.update(keys[None, None], 2 * keys[None, None], layer)
    running = RunningCache(cache, prompt_len=2, position_dims=1)
    running.appended(torch.arange(6), torch.arange(2, 8).view(1, -1))
    state = StreamState(
        cache=running,
        token_step=torch.arange(16),
        layout_positions=torch.arange(2, 19).view(1, -1),
        total=16,
        seen=6,
        rope=(INV_FREQ.float(), torch.zeros(D // 2, dtype=torch.long)),
    )
    return state, keys


def compressed(deep_attention: list[float], continue_at: str = "layer_end"):
    torch.manual_seed(3)
    raw_prompt, raw_visual = torch.randn(2, D, dtype=torch.float64), torch.randn(6, D).double()
    state, keys = two_layers(raw_prompt, raw_visual)
    flat = torch.ones(6)
    state.attend = lambda texts, **how: [[flat, torch.tensor(deep_attention)] for _ in texts]
    params = HermesParams(
        reindex="lazy", shallow_share=0.5, deep_share=0.5, continue_at=continue_at
    )
    before = [state.cache.cache.layers[n].keys[0, 0].double().clone() for n in range(2)]
    HermesMemory(params, Budget(tokens=4), EncodeContext("video")).after_chunk(state)
    return state, before


def held(state, layer) -> tuple[torch.Tensor, list[int]]:
    """A layer's keys [n, D] and positions, prompt first."""
    running = state.cache
    keys = running.cache.layers[layer].keys[0, 0].double()
    prompt = [p + running.prompt_shift[layer] for p in (0, 1)]
    return keys, prompt + running.positions[layer][0].tolist()


def test_each_layer_attends_as_the_code_places_its_next_chunk():
    """The deep layer keeps its first three tokens and folds the last three into a summary at 5:
    the code starts its next chunk at 6, the shallow layer's (its newest token kept, at 7) at 8. In
    mmkv both continue at 8, the deep layer moved up by 2: a query there scores each layer's keys
    exactly as a query at the code's place scores the keys where the code keeps them."""
    state, before = compressed([0.9, 0.8, 0.7, 0.1, 0.1, 0.1])
    assert int(state.placed(6, 7)[0, 0]) == 8 and state.shift == 0
    assert state.cache.prompt_shift == [0, 2]
    keys, positions = held(state, 1)
    assert positions == [2, 3, 4, 5, 6, 7]  # prompt, tokens 0..2, the summary: all moved by 2
    query = torch.randn(1, D, dtype=torch.float64)
    code_keys = keys.clone()  # where the code keeps them: every key 2 positions back
    code_keys = rope(code_keys, [-2] * len(positions))
    ours = rope(query, [8]) @ keys.T
    theirs = rope(query, [6]) @ code_keys.T  # the code's next chunk in the deep layer: at 6
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # the prompt's keys are the ones prefilled, turned by the move; the shallow layer is untouched
    torch.testing.assert_close(keys[:2], rope(before[1][:2], [2, 2]), atol=1e-5, rtol=1e-5)
    shallow, where = held(state, 0)
    assert where[:2] == [0, 1] and max(where) == 7  # the newest kept where the forward put it
    torch.testing.assert_close(shallow[:2], before[0][:2])


def test_a_summary_never_shares_its_position_with_the_next_token():
    """The deep layer keeps its last token (at 7): its summary goes to 8, where the stream would go
    on. The code starts that layer's next chunk at 9; mmkv moves the stream up by one and the
    shallow layer with it. `continue_at: stream` (mmkv before) put both at 8."""
    state, _ = compressed([0.9, 0.1, 0.1, 0.1, 0.8, 0.7])
    next_position = int(state.placed(6, 7)[0, 0])
    assert next_position == 9 and state.shift == -1
    for layer in range(2):
        assert max(held(state, layer)[1]) == next_position - 1
    assert state.cache.prompt_shift == [1, 0]
    before, _ = compressed([0.9, 0.1, 0.1, 0.1, 0.8, 0.7], continue_at="stream")
    assert max(held(before, 1)[1]) == int(before.placed(6, 7)[0, 0]) == 8  # the collision


@pytest.mark.parametrize("reindex", ["lazy", "eager"])
def test_every_layer_of_a_pack_ends_right_before_what_follows_it(backbones, reindex):
    """A whole encode (every chunk compressed): in each layer, the prompt sits where its moves put
    it, and the suffix after the stream follows the layer's furthest entry at once."""
    backbone = backbones["tiny-llava-ov"]
    media = load_media("samples/clip.mp4", fps=8, max_frames=32)
    choice = choose("hermes", budget_tokens=24, chunk_frames=4, reindex=reindex)
    out = encode_media(backbone, media, choice)
    first = int(out.suffix.positions[0][0, 0])
    prompt = out.prefix.layer_counts[0]
    moved = set()
    for layer, prefix in enumerate(out.prefix.positions):
        shift = int(prefix[0, 0])
        assert prefix[0].tolist() == list(range(shift, shift + prompt))
        moved.add(shift)
        furthest = max(
            int(b.positions[layer].max()) for b in out.blocks if b.positions[layer].numel()
        )
        assert furthest + 1 == first, layer
    # lazy: layers moved by different amounts (one position for all would not do); eager: each
    # compaction ends every layer at its budget (a deep one's summary the last), so none moves
    assert len(moved) > 1 if reindex == "lazy" else moved == {0}
