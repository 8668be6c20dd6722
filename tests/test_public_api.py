"""The public API is `mmkv`'s `__all__`: every name documented and annotated, the method classes
made from the registry (and methods.pyi equal to them), the verbs returning typed records."""

import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
import typing

import pytest

import mmkv
from mmkv import _stubs, methods
from mmkv_cli.api import stored_method
from mmkv_cli.core import errors
from mmkv_cli.methods import METHODS
from mmkv_cli.methods.choice import resolve_method
from mmkv_cli.pack import PackReader
from mmkv_cli.presets import preset_names


def _public_members(obj):
    for name, member in vars(obj).items():
        if not name.startswith("_") and (
            inspect.isfunction(member) or isinstance(member, property)
        ):
            yield name, member


def _annotated(function, where):
    signature = inspect.signature(function)
    missing = [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls") and parameter.annotation is inspect.Parameter.empty
    ]
    assert not missing, f"{where}: no annotation for {missing}"
    assert signature.return_annotation is not inspect.Signature.empty, f"{where}: no return type"


def test_every_public_name_is_documented_and_annotated():
    assert sorted(dir(mmkv)) == sorted(mmkv.__all__)  # nothing imported shows as public
    for name in mmkv.__all__:
        member = getattr(mmkv, name)
        if name == "__version__":
            assert isinstance(member, str)
            continue
        assert (member.__doc__ or "").strip(), f"mmkv.{name} has no docstring"
        if inspect.isfunction(member):
            _annotated(member, f"mmkv.{name}")
        elif inspect.isclass(member):
            for attribute, function in _public_members(member):
                function = function.fget if isinstance(function, property) else function
                assert (function.__doc__ or "").strip(), f"mmkv.{name}.{attribute}: no docstring"
                _annotated(function, f"mmkv.{name}.{attribute}")
            if dataclasses.is_dataclass(member):  # each field named in its class's docstring
                docs = "".join(cls.__doc__ or "" for cls in member.__mro__)
                for field in dataclasses.fields(member):
                    assert f"{field.name}:" in docs, f"mmkv.{name}.{field.name}"


def test_every_error_is_exported_with_its_exit_code():
    defined = {
        cls for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, Exception)
    }
    exported = {getattr(mmkv, name) for name in mmkv.__all__}
    assert defined <= exported
    codes = [cls.exit_code for cls in defined if cls is not errors.MmkvError]
    assert len(set(codes)) == len(codes) and all(2 <= code < 64 for code in codes)


def test_one_class_per_registered_method_with_its_parameters_at_their_defaults():
    assert {cls.method for cls in methods.CLASSES.values()} == set(METHODS)
    for name, method in METHODS.items():
        cls = getattr(methods, method.label)
        built = cls()
        for field in dataclasses.fields(method.params):
            assert getattr(built, field.name) == getattr(method.params(), field.name)
            assert field.metadata["doc"] in cls.__doc__
        assert built.spec().name == name and method.paper.title in cls.__doc__
        keywords = inspect.signature(cls).parameters
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in keywords.values())
    assert _stubs.STUB.read_text() == _stubs.render(), (
        "methods.pyi differs from the registry: run `python -m mmkv._stubs`"
    )


def test_a_method_object_is_checked_when_built_and_shows_its_values():
    hermes = methods.HERMES(budget_tokens=4096, deep_share=0.4, smoothing={"deep": 0.5})
    assert hermes.smoothing.deep == 0.5 and hermes.smoothing.shallow == 0.1  # a typed value now
    assert repr(hermes).startswith("HERMES(budget=None, budget_tokens=4096, reduce=None,")
    assert "deep_share=0.4" in repr(hermes)
    with pytest.raises(mmkv.UsageError, match=r"deep_share: 2.0 is above the maximum 1"):
        methods.HERMES(deep_share=2)
    with pytest.raises(mmkv.UsageError, match="is not one of dot, cosine"):
        methods.ReKV(similarity="euclid")
    with pytest.raises(mmkv.UsageError, match=r"^give budget \(a share\) or budget_tokens, not"):
        methods.SnapKV(budget=0.5, budget_tokens=10)  # Python's words, not --budget
    with pytest.raises(mmkv.UsageError, match="keeps every token: budget does not apply"):
        methods.Full(budget=0.5)
    with pytest.raises(mmkv.UsageError, match="unknown token reducer|unknown reducer"):
        methods.HERMES(reduce="zip")
    with pytest.raises(TypeError, match="unexpected keyword argument 'window'"):
        methods.SnapKV(window=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hermes.deep_share = 0.5


def test_get_builds_a_preset_as_its_method_class_at_the_presets_values():
    for name in sorted(preset_names("methods")):
        built = methods.get(name)
        choice = resolve_method(name)
        assert type(built).method == choice.method.name
        for field in dataclasses.fields(choice.method.params):
            assert getattr(built, field.name) == getattr(choice.params, field.name), (name, field)
    assert methods.get("hermes", deep_share=0.5).deep_share == 0.5


def test_a_presets_reducer_parameters_carry_over_to_its_method_object(tmp_path):
    from mmkv_cli.methods.choice import choice_for
    from mmkv_cli.presets import use_presets

    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "tom.yaml").write_text(
        "extends: streamingtom\nreduce_params: {retain: 0.5, beta: 0.2}\n"
    )
    (tmp_path / "methods" / "zip.yaml").write_text(
        "extends: hermes\nreduce: visionzip\nreduce_params: {contextual: 0.25}\n"
    )
    use_presets(tmp_path)
    try:
        for name in ("tom", "zip"):
            built, preset = methods.get(name), resolve_method(name).reduce
            assert choice_for(built.encode_options()).reduce == preset  # was the defaults
        tom = methods.get("tom")
    finally:
        use_presets(None)
    assert tom.reduce is None and tom.reduce_params["retain"] == 0.5  # ctr: StreamingTOM's own
    given = methods.StreamingTOM(reduce_params={"beta": 0.3})  # over the reducer's defaults
    assert choice_for(given.encode_options()).reduce.params.beta == 0.3
    with pytest.raises(mmkv.UsageError, match="reduce_params given without a reducer"):
        methods.HERMES(reduce_params={"drop_threshold": 0.5})
    with pytest.raises(mmkv.UsageError, match="drop"):
        methods.HERMES(reduce="dtd", reduce_params={"drop": 0.5})


def test_a_method_objects_reducer_parameters_reach_the_pack(tmp_path, clip):
    dtd = methods.Full(reduce="dtd", reduce_params={"drop_threshold": 1.0})  # drops nothing
    done = mmkv.encode(clip, tmp_path / "d.kvpack", model="demo", method=dtd)
    assert PackReader(tmp_path / "d.kvpack").header.method.reduce["params"]["drop_threshold"] == 1.0
    assert done.details["visual_tokens_prefilled"] == done.details["visual_tokens_total"]


def test_a_method_object_encodes_what_its_values_say(tmp_path, clip):
    hermes = methods.HERMES(budget_tokens=24, deep_share=0.5, summary=False)
    done = mmkv.encode(clip, tmp_path / "h.kvpack", model="demo", method=hermes)
    assert isinstance(done, mmkv.EncodeResult) and done.budget_tokens == 24
    assert done.method == "hermes" and done.encode_s > 0 and done.frames == 16
    _, params = stored_method(PackReader(tmp_path / "h.kvpack"))
    assert params.deep_share == 0.5 and params.summary is False
    assert "summary" not in done.details["granularities"]  # no summary token: it was off
    with pytest.raises(mmkv.UsageError, match="budget_tokens is set on the method object"):
        mmkv.encode(clip, tmp_path / "x.kvpack", model="demo", method=hermes, budget_tokens=8)
    info = mmkv.inspect(tmp_path / "h.kvpack")
    assert info == mmkv.PackInfo.from_record(info.details) and info.blocks == done.blocks


def test_convert_verify_and_the_listings_return_typed_records(tmp_path, clip):
    mmkv.encode(clip, tmp_path / "f.kvpack", model="demo", method="recency", budget=0.5)
    converted = mmkv.convert(tmp_path / "f.kvpack", tmp_path / "q.kvpack", kv_bits=4, stop=4.0)
    assert converted.kv_bits == 4 and converted.bytes < mmkv.inspect(tmp_path / "f.kvpack").bytes
    report = mmkv.verify(tmp_path / "q.kvpack")
    assert report.ok and report.faults == [] and report.bytes_checked > 0
    with pytest.raises(mmkv.UsageError, match="pass kv_bits too"):
        mmkv.convert(tmp_path / "f.kvpack", tmp_path / "r.kvpack", kv_group=32)
    listed = {m.name: m for m in mmkv.list_methods()}
    assert set(METHODS) <= set(listed) and listed["hermes"].label == "HERMES"
    assert {p.name for p in listed["hermes"].params} >= {"deep_share", "summary"}
    models = {m.name: m for m in mmkv.list_models()}
    assert models["demo"].weights == "built in" and sum(m.default for m in models.values()) == 1
    with mmkv.open(tmp_path / "f.kvpack") as pack:
        assert repr(pack) == (
            f"Pack('{tmp_path / 'f.kvpack'}', method='recency', blocks={pack.info().blocks}, "
            "model='demo')"
        )


def test_live_answers_the_questions_it_was_given_and_those_pushed_in(tmp_path, clip):
    source = tmp_path / "clip.mp4"
    shutil.copy(clip, source)
    asked = ["what color is the circle ?", ("which shape appeared first ?", 2.0)]
    following = mmkv.live(
        str(source), tmp_path / "live.kvpack", model="demo", method="recency",
        budget_tokens=24, questions=asked, stall=0.5, max_new_tokens=4,
    )  # fmt: skip
    pushed = following.ask("which shape appeared last ?", at=1.0)
    answers = list(following)
    assert [a.question for a in sorted(answers, key=lambda a: a.id)] == [asked[0], asked[1][0]]
    assert all(a.answer and a.error is None for a in answers)
    assert next(a for a in answers if a.at == 2.0).moment == 2.0  # the memory at its moment
    late = pushed.result(timeout=60)
    assert late.answer and late.moment <= 1.0
    result = following.wait()
    assert result.stopped == "ended" and result.frames == 16 and result.path.endswith("live.kvpack")
    assert mmkv.inspect(result.path).method == "recency"
    with mmkv.live(
        str(source), tmp_path / "held.kvpack", model="demo",
        method=methods.HERMES(budget_tokens=24), stall=30,
    ) as held:  # fmt: skip
        answer = held.ask("what color is the circle ?").result(timeout=60)
        assert answer.answer and answer.error is None
    assert mmkv.inspect(tmp_path / "held.kvpack").method == "hermes"  # stopped: the pack kept
    with pytest.raises(mmkv.OutputExistsError, match="pass force=True"):
        mmkv.live(str(source), tmp_path / "held.kvpack", model="demo")


def test_eval_from_python_runs_as_the_cli_does(tmp_path):
    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app

    synth = ["synth", str(tmp_path / "set"), "--clips", "1", "--frames", "8", "--kind", "normal"]
    assert CliRunner().invoke(app, synth).exit_code == 0
    result = mmkv.eval(
        tmp_path / "set" / "qa.jsonl", tmp_path / "out", methods=["full", "recency"],
        budgets=[0.5], model="demo", protocol="replay", max_new_tokens=2, limit=4,
    )  # fmt: skip
    assert [(run["method"], run["budget"]) for run in result.runs] == [
        ("full", 1.0),
        ("recency", 0.5),
    ]
    assert all(0 <= run["accuracy"] <= 1 for run in result.runs) and result.plot.endswith(".png")
    assert json.loads(json.dumps(result.runs))  # plain records


def test_annotations_resolve_at_runtime():
    for name in ("encode", "ask", "live", "convert", "eval"):
        typing.get_type_hints(getattr(mmkv, name))
    typing.get_type_hints(mmkv.Pack.ask)


def test_reading_packs_and_listing_from_python_never_imports_torch(tmp_path, clip):
    pack = tmp_path / "p.kvpack"
    mmkv.encode(clip, pack, model="demo", max_frames=4)
    script = (
        "import sys, mmkv\n"
        f"assert mmkv.verify({str(pack)!r}).ok and mmkv.inspect({str(pack)!r}).blocks\n"
        "assert mmkv.list_methods() and mmkv.list_models()\n"
        "mmkv.methods.HERMES(budget_tokens=64, deep_share=0.4)\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_python_keywords_and_cli_options_share_their_names():
    """One set of names (issue 75): each keyword of `mmkv.encode`, `ask`, `live`, `convert` and
    `eval` is an option of the command of the same name, spelled the same (start, not --from);
    every command that writes takes -o / --out, as Python's `out`."""
    import inspect as py_inspect

    import typer

    from mmkv_cli.cli.app import app

    commands = typer.main.get_command(app).commands
    for name in ("encode", "ask", "live", "convert", "eval"):
        signature = py_inspect.signature(getattr(mmkv, name)).parameters.values()
        keywords = {p.name for p in signature if p.kind is p.KEYWORD_ONLY} - {"progress"}
        options = {
            option.lstrip("-").replace("-", "_")
            for param in commands[name].params
            for option in param.opts
            if option.startswith("--")
        }
        assert keywords <= options, (name, keywords - options)
    for name in ("encode", "live", "eval", "batch"):
        written = next(p for p in commands[name].params if "--out" in p.opts)
        assert "-o" in written.opts, name
    # and HTTP: a stream's fields are mmkv.live's keywords (its name and source aside)
    from mmkv_cli.serve.streams import StreamRequest

    live = set(py_inspect.signature(mmkv.live).parameters)
    assert set(StreamRequest.model_fields) - {"name", "source"} <= live
