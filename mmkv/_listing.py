"""`mmkv.list_methods` and `mmkv.list_models`: the registries as typed records."""

from __future__ import annotations

from mmkv._results import MethodInfo, ModelInfo, ParamInfo


def list_methods() -> list[MethodInfo]:
    """Every compression method and preset with its paper, default budget and parameters (as
    `mmkv methods`); `mmkv.methods.<label>` is a method's class."""
    from mmkv_cli.methods.choice import method_listing

    return [
        MethodInfo(
            name=row["name"],
            implements=row["implements"],
            label=row["label"],
            description=row["description"],
            paper=row["paper"]["title"],
            year=row["paper"]["year"],
            budget_share=row["budget_share"],
            budget_tokens=row["budget_tokens"],
            params=[ParamInfo(p["name"], p["type"], p["value"], p["doc"]) for p in row["params"]],
        )
        for row in method_listing()
    ]


def list_models() -> list[ModelInfo]:
    """Every model preset, with where its weights are (as `mmkv models`); any HF id or local
    folder of a supported family works too."""
    from mmkv_cli.backbones.spec import model_listing

    return [ModelInfo(**row) for row in model_listing()]
