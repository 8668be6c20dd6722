"""Typed method specs, presets shipped in the package, declared seams, and the per-layer running
cache."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from mmkv_cli.backbones.spec import load_model_spec, model_names
from mmkv_cli.cli.app import app
from mmkv_cli.cli.display import kept_label
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.spec import describe, override
from mmkv_cli.methods import METHODS
from mmkv_cli.methods.base import GuidedParams
from mmkv_cli.methods.choice import resolve_method
from mmkv_cli.methods.running_cache import RunningCache
from tests.conftest import ROOT, SAMPLES
from tests.helpers import encode_pack

runner = CliRunner()


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_declares_typed_documented_parameters_and_a_paper(name):
    method = METHODS[name]
    assert dataclasses.is_dataclass(method.params) and method.params.__dataclass_params__.frozen
    for row in describe(method.params):
        assert row["doc"], f"{name}.{row['name']} has no meaning"
    assert method.paper.title and 2000 < method.paper.year < 2100
    assert (method.streaming is None) != (method.blockwise is None)  # exactly one memory seam
    if method.prune_at_ask is not None:
        assert isinstance(method.params(), GuidedParams)  # it scores by a prompt's attention


def test_overrides_are_checked_field_by_field():
    params = resolve_method("mukv").params
    changed = override(params, {"rho": {"patch": 0.2}, "k": {"frame": 8}}, "here")
    assert changed.rho.patch == 0.2 and changed.rho.segment == params.rho.segment
    assert changed.k.frame == 8 and changed.k.patch == params.k.patch
    for values, message in [
        ({"rho": {"patchy": 0.2}}, "here.rho: unknown key 'patchy'"),
        ({"rho": {"patch": 2.0}}, "here.rho.patch: 2.0 is above the maximum 1"),
        ({"k": {"frame": 1.5}}, "here.k.frame: expected a whole number"),
        ({"frequency": "fast"}, "here.frequency: 'fast' is not one of fft, diff"),
        ({"batch_tokens": None}, "here.batch_tokens: null is not allowed"),
    ]:
        with pytest.raises(UsageError, match=message.replace(".", r"\.").replace("(", r"\(")):
            override(params, values, "here")
    hermes = override(resolve_method("hermes").params, {"recency_k": [10, 1]}, "h")
    assert hermes.recency_k == (10.0, 1.0)
    with pytest.raises(UsageError, match="expected a list of 2"):
        override(hermes, {"recency_k": [10]}, "h")


def test_methods_json_lists_parameters_types_defaults_and_papers():
    listed = json.loads(runner.invoke(app, ["methods", "--json"]).stdout)["methods"]
    rows = {m["name"]: m for m in listed}
    assert set(METHODS) <= set(rows) and {"hermes-6k", "mukv-middle"} <= set(rows)
    snap = {p["name"]: p for p in rows["snapkv"]["params"]}
    assert snap["pool_kernel"]["type"] == "int" and snap["pool_kernel"]["default"] == 7
    assert snap["guidance_prompt"]["type"] == "str | null"
    assert rows["mukv"]["paper"]["title"].startswith("MuKV") and rows["hermes"]["paper"]["year"]
    views = {p["name"]: p for p in rows["mukv-middle"]["params"]}["views"]
    assert views["default"] == "stream" and views["value"] == "middle_frame"
    assert rows["full"]["budget"] == "keeps all" and rows["hermes"]["budget_tokens"] == 4096
    assert (
        "prune-at-ask" in rows["aircache"]["abilities"] and "retrieval" in rows["rekv"]["abilities"]
    )


def test_model_presets_are_typed_too(tmp_path, monkeypatch):
    assert {"demo", "tiny-qwen3-vl", "llava-ov-7b"} <= set(model_names())
    spec = load_model_spec("tiny-qwen2-vl")
    assert spec.family == "qwen2_vl" and spec.fps == 2.0 and spec.seed == 0
    assert load_model_spec("Qwen/Qwen2-VL-2B-Instruct") is None  # an HF id, not a preset
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "bad.yaml").write_text("family: qwen2_vl\nsource: x\nfsp: 2\n")
    (tmp_path / "models" / "nofamily.yaml").write_text("source: x\n")
    monkeypatch.setenv("MMKV_PRESETS", str(tmp_path))
    with pytest.raises(UsageError, match="bad.yaml: unknown key 'fsp'"):
        load_model_spec("bad")
    with pytest.raises(UsageError, match="lacks the field 'family'"):
        load_model_spec("nofamily")
    with pytest.raises(UsageError, match="not a method name"):
        resolve_method("../../etc/x")


def test_every_family_in_the_registry_has_its_adapter_and_a_tiny_preset():
    from mmkv_cli.backbones import FAMILIES
    from mmkv_cli.backbones.base import Backbone, PromptPieces
    from mmkv_cli.backbones.loading import adapter_for, tiny_builder

    tiny = {load_model_spec(n).family for n in model_names() if load_model_spec(n).source == "tiny"}
    assert tiny == set(FAMILIES)  # so the round-trip and contract tests cover every family
    for family in FAMILIES:
        adapter, prompt = adapter_for(family)
        assert issubclass(adapter, Backbone) and isinstance(prompt, PromptPieces)
        assert callable(tiny_builder(family))
    with pytest.raises(UsageError, match="is not one of"):  # a family not in the registry
        override(load_model_spec("tiny-qwen2-vl"), {"family": "gpt2"}, "x.yaml")


def test_the_running_cache_keeps_keys_values_positions_and_stream_index_together():
    from transformers import DynamicCache

    cache = DynamicCache()
    prompt, heads, dim = 2, 1, 4
    keys = torch.arange(7 * dim, dtype=torch.float32).reshape(1, heads, 7, dim)
    cache.update(keys, -keys, 0)
    running = RunningCache(cache, prompt, position_dims=1)
    running.appended(torch.arange(10, 15), torch.arange(100, 105)[None])  # 5 visual tokens
    running.retain(0, torch.tensor([1, 3, 4]))
    k, v = running.visual(0)
    assert torch.equal(k[0, :, 0], keys[0, 0, [3, 5, 6], 0]) and torch.equal(v, -k)
    assert running.index[0].tolist() == [11, 13, 14] and running.positions[0].tolist() == [
        [101, 103, 104]
    ]
    running.insert_front(0, torch.full((1, 1, dim), 9.0), torch.full((1, 1, dim), -9.0))
    assert running.visual_start(0) == 3 and running.count(0) == 3
    assert torch.equal(
        running.visual(0)[0], k
    )  # the visual part moved behind the summary, unchanged
    running.replace(0, keys=torch.zeros(1, 3, dim), positions=torch.tensor([[7, 8, 9]]))
    assert running.visual(0)[0].abs().sum() == 0 and torch.equal(running.visual(0)[1], v)
    assert running.positions[0].tolist() == [[7, 8, 9]] and cache.layers[0].keys.shape[2] == 6
    with running.scratch():
        cache.update(torch.ones(1, heads, 2, dim), torch.ones(1, heads, 2, dim), 0)
    assert cache.layers[0].keys.shape[2] == 6  # what a scoring forward appended is gone


def test_inspect_reports_the_kv_share_averaged_over_layers(tmp_path, backbones):
    backbone = backbones["tiny-llava-ov"]
    info = encode_pack(
        SAMPLES / "clip.mp4",
        tmp_path / "p.kvpack",
        method="pyramidkv",
        budget=0.1,
        backbone=backbone,
    )
    layers = [layer["tokens_kept"] for layer in info["layers"]]
    assert max(layers) > min(layers)  # pyramid budgets differ per layer
    assert info["visual_tokens_kept"] == pytest.approx(sum(layers) / len(layers))
    assert info["visual_kv_share"] == pytest.approx(
        info["visual_tokens_kept"] / info["visual_tokens_total"], abs=1e-4
    )
    mukv = encode_pack(
        SAMPLES / "clip.mp4", tmp_path / "m.kvpack", method="mukv", backbone=backbone
    )
    # the tiny grid's patch blocks are too small to keep a token at rho 0.1: not stored
    assert mukv["overlapping_views"] == ["segment", "frame"]
    shares = {g: mukv["granularities"][g]["stream_share"] for g in mukv["overlapping_views"]}
    assert sum(shares.values()) == pytest.approx(mukv["visual_kv_share"], abs=1e-3)
    assert mukv["visual_kv_share"] <= 1.0
    assert "as 2 overlapping views of the stream" in kept_label(mukv)


def test_help_methods_inspect_and_verify_never_import_torch(tmp_path, backbones):
    pack = tmp_path / "p.kvpack"
    encode_pack(SAMPLES / "clip.mp4", pack, backbone=backbones["tiny-qwen2-vl"], max_frames=4)
    probe = (
        "import sys\nfrom mmkv_cli.cli.app import main\nsys.argv = ['mmkv', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as done:\n    code = done.code\n"
        "print('LOADED', 'torch' in sys.modules, 'transformers' in sys.modules, code)\n"
    )
    for args in (
        ["--help"],
        ["methods", "--json"],
        ["models"],
        ["inspect", str(pack), "--json"],
        ["verify", str(pack)],  # stored as computed: numpy checks every byte and value
        ["ls", str(tmp_path), "--verify"],
        ["inspect", str(tmp_path)],
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.stdout.strip().splitlines()[-1] == "LOADED False False 0", (args, done.stderr)


def test_an_encode_leaves_no_running_cache_waiting_for_the_cycle_collector(backbones):
    import gc

    from mmkv_cli.encode.encoder import encode_media
    from mmkv_cli.media import load_media
    from mmkv_cli.methods.running_cache import StreamState
    from tests.helpers import choose

    media = load_media(str(SAMPLES / "clip.mp4"), fps=4, max_frames=8)
    gc.collect()
    gc.disable()
    try:
        encode_media(backbones["tiny-llava-ov"], media, choose("snapkv", budget=0.5))
        alive = [o for o in gc.get_objects() if type(o) is StreamState]
    finally:
        gc.enable()
    assert not alive  # freed by reference counting as soon as the encode returns
