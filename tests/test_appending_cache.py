"""An ask's cache writes its question and each answer token into room after the context
(backbones/appending.py), where transformers' DynamicLayer copied the whole context each time: the
same keys and values after every update, the context as given never written, the room made again
only when used up."""

from __future__ import annotations

import torch

from mmkv_cli import api
from mmkv_cli.backbones import appending, base
from mmkv_cli.backbones.appending import AppendingLayer
from mmkv_cli.backbones.loading import load_backbone
from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, LoadOptions


def test_updates_give_the_concatenated_context_and_never_write_the_given_one():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 10, 4, generator=g), torch.randn(1, 2, 10, 6, generator=g)
    given = keys.clone(), values.clone()
    layer = AppendingLayer(keys, values, room=3)
    want_keys, want_values, buffers = keys, values, set()
    for added in (4, *[1] * 10):  # a question, then an answer token at a time
        new_keys = torch.randn(1, 2, added, 4, generator=g)
        new_values = torch.randn(1, 2, added, 6, generator=g)
        got_keys, got_values = layer.update(new_keys, new_values)
        want_keys = torch.cat([want_keys, new_keys], dim=-2)
        want_values = torch.cat([want_values, new_values], dim=-2)
        assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
        assert layer.get_seq_length() == want_keys.shape[-2]
        buffers.add(got_keys.data_ptr())
    # room for 3 after 14 tokens, then for 6 after 18: ten answer tokens made room twice
    assert len(buffers) == 2
    assert torch.equal(keys, given[0]) and torch.equal(values, given[1])


def test_a_context_replaced_or_cropped_between_updates_is_followed():
    keys, values = torch.arange(24.0).reshape(1, 1, 6, 4), -torch.arange(24.0).reshape(1, 1, 6, 4)
    layer = AppendingLayer(keys, values)
    layer.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    kept = torch.tensor([0, 2, 5, 7])  # a pruned context, as ask --prune leaves it
    layer.keys, layer.values = layer.keys[:, :, kept], layer.values[:, :, kept]
    got, _ = layer.update(torch.full((1, 1, 1, 4), 9.0), torch.full((1, 1, 1, 4), 9.0))
    want = torch.cat([torch.cat([keys, torch.ones(1, 1, 2, 4)], 2)[:, :, kept],
                      torch.full((1, 1, 1, 4), 9.0)], 2)  # fmt: skip
    assert torch.equal(got, want)
    layer.crop(-2)  # transformers' crop: the last two dropped
    got, _ = layer.update(torch.full((1, 1, 1, 4), 7.0), torch.full((1, 1, 1, 4), 7.0))
    assert torch.equal(got, torch.cat([want[:, :, :3], torch.full((1, 1, 1, 4), 7.0)], 2))


def test_an_ask_decodes_as_with_concatenation(clip, tmp_path, monkeypatch):
    backbone = load_backbone(LoadOptions("demo", "cpu"))
    pack = tmp_path / "clip.kvpack"
    api.encode(clip, pack, EncodeOptions("full", force=True), backbone=backbone)
    options = AskOptions(generation=GenerationOptions(max_new_tokens=12), keep_logits=True)
    made = []
    real = appending.AppendingLayer

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "AppendingLayer", counted)
    question = "what color is the circle ?"
    appended = api.PackSession(pack, backbone=backbone).ask(question, options)
    assert made  # the ask's cache appended into room

    class Concatenating(real):
        def update(self, key_states, value_states, *args, **kwargs):
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values

    monkeypatch.setattr(base, "AppendingLayer", Concatenating)
    concatenated = api.PackSession(pack, backbone=backbone).ask(question, options)
    assert appended.token_ids == concatenated.token_ids
    assert torch.equal(appended.first_logits, concatenated.first_logits)
