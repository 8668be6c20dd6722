"""On CUDA an attention that `_attention` declares causal runs flash attention with no mask at all
(grouped_sdpa): every query row sees the keys up to its own place, the queries the newest. That
holds only because mmkv never runs the language model padded, and no family adds to the causal
pattern. Here every mask so declared, in encodes and asks of every family, is checked to be
exactly that, so a change that breaks it (a padded batch, a family's own mask) fails on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from mmkv_cli.backbones.base import text_kv
from mmkv_cli.core.options import MethodSpec
from mmkv_cli.kernels import attention
from tests.conftest import TINY
from tests.helpers import ask_pack, encode_pack


@pytest.fixture
def declared(monkeypatch):
    """Every (rows, keys, the mask as given) that grouped_sdpa is told is causal."""
    seen, real = [], attention.grouped_sdpa

    def watched(module, query, key, value, mask, causal=False, **kwargs):
        if causal:  # the model's mask, for layer 0's length: the layer's own made from it
            seen.append((query.shape[2], key.shape[2], attention.own_length_mask(query, key, mask)))
        return real(module, query, key, value, mask, causal, **kwargs)

    monkeypatch.setattr(attention, "grouped_sdpa", watched)
    return seen


def newest_last(rows: int, keys: int) -> torch.Tensor:
    return torch.arange(keys)[None] <= torch.arange(rows)[:, None] + (keys - rows)


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("method,budget", [("full", None), ("hermes", 0.3), ("rekv", None)])
def test_every_mask_declared_causal_is_causal_alone(
    backbones, clip, tmp_path, declared, model, method, budget
):
    """full: chunks over a growing cache; hermes: a cache evicted under a budget; rekv: blocks
    spliced into each layer while the question runs."""
    pack = tmp_path / "clip.kvpack"
    backbone = backbones[model]
    choice = MethodSpec(method, {"chunk_frames": 4})
    encode_pack(clip, pack, method=choice, budget=budget, backbone=backbone, max_frames=16)
    ask_pack(pack, "What happens?", backbone=backbone, max_new_tokens=2)
    chunks = {(rows, keys) for rows, keys, mask in declared if 1 < rows < keys and mask is not None}
    assert len(chunks) >= 3, "chunks over a cache, and a question"
    for rows, keys, mask in declared:
        if mask is None:  # SDPA's own causal flag: rows == keys, or one row seeing all
            assert rows in (1, keys)
            continue
        visible = mask if mask.dtype == torch.bool else mask == 0
        assert visible.shape[-2:] == (rows, keys)
        assert torch.equal(visible, newest_last(rows, keys).expand_as(visible)), (rows, keys)


def answers_unmasked(backbone, clip, tmp_path, monkeypatch, method: str, budget, watch=()):
    """(the answer with the model's causal masks, the answer with the flash path forced and no
    mask made, what the mask function gave for each forward). watch: kernels.attention functions
    whose calls are counted in the second (name -> calls, returned fourth)."""
    text = backbone.model.config.get_text_config()

    def answer(tag: str):
        pack = tmp_path / f"{tag}.kvpack"
        choice = MethodSpec(method, {"chunk_frames": 4})
        encode_pack(clip, pack, method=choice, budget=budget, backbone=backbone, max_frames=16)
        return ask_pack(
            pack, "What happens?", backbone=backbone, max_new_tokens=3, keep_logits=True
        )

    masked = answer("masked")
    monkeypatch.setattr(text, "_attn_implementation", text._attn_implementation)  # put back after
    monkeypatch.setattr(attention, "_flash_lower_right", lambda *_: True)
    made, unmade, calls = [], attention._causal_unmade, dict.fromkeys(watch, 0)

    def watched(*args, **kwargs):
        made.append(unmade(*args, **kwargs))
        return made[-1]

    def counted(name: str, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(attention, "_causal_unmade", watched)  # as install() registers it
    for name in watch:
        monkeypatch.setattr(attention, name, counted(name, getattr(attention, name)))
    kv = text_kv(text)
    attention.install(backbone.model, text.num_attention_heads, kv["kv_heads"], kv["head_dim"])
    assert text._attn_implementation == attention.UNMASKED_NAME
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch names the kernels it could not use on the CPU
        unmasked = answer("unmasked")
    return masked, unmasked, made, calls


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("method,budget", [("full", None), ("hermes", 0.3)])
def test_a_model_flash_runs_makes_no_mask_and_answers_the_same(
    backbones, clip, tmp_path, monkeypatch, model, method, budget
):
    """Where flash attention runs a model's heads, install() has the model make no causal mask (a
    chunk's over an hour's keys is a GB): every layer's attention is told causal with no mask, and
    the packs answer as they did with one. On the CPU the flash path is forced; torch lays its
    causal bias out there, so what is checked is the meaning, not the kernel."""
    masked, unmasked, made, calls = answers_unmasked(
        backbones[model], clip, tmp_path, monkeypatch, method, budget, ["grouped_sdpa"]
    )
    assert len(made) >= 3 and all(mask is None for mask in made)
    assert calls["grouped_sdpa"] > 0
    assert unmasked.token_ids == masked.token_ids
    assert torch.allclose(unmasked.first_logits, masked.first_logits, atol=1e-4)


def test_a_cache_held_per_head_makes_its_own_masks_with_none_from_the_model(
    clip, tmp_path, monkeypatch
):
    """H2O on the trained demo backbone (its heads keep different tokens; a tiny random model's
    all agree): the encode's running cache is held per KV head, and each layer makes its own
    causal mask, narrowed to its heads' entries, where the model makes none. The same answer."""
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.core.options import LoadOptions

    demo = load_backbone(LoadOptions("demo", "cpu"))
    masked, unmasked, made, calls = answers_unmasked(
        demo, clip, tmp_path, monkeypatch, "h2o", 0.3, ["with_heads"]
    )
    assert made and all(mask is None for mask in made)
    assert calls["with_heads"] > 0
    assert unmasked.token_ids == masked.token_ids
    assert torch.allclose(unmasked.first_logits, masked.first_logits, atol=1e-4)
