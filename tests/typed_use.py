"""Not a test module: what a user's code looks like to a type checker. `make test` runs mypy over
it (strict): every line must check, and each `type: ignore` must still be needed, so a method class
that lost its parameters' types in methods.pyi fails the build."""

from __future__ import annotations

import mmkv
from mmkv import methods


def use(clip: str, out: str) -> list[str]:
    hermes = methods.HERMES(budget_tokens=4096, deep_share=0.4, smoothing={"deep": 0.5})
    deep: float = hermes.deep_share
    done: mmkv.EncodeResult = mmkv.encode(clip, out, model="demo", method=hermes, force=True)
    info: mmkv.PackInfo = mmkv.inspect(done.path)
    answer: mmkv.Answer = mmkv.ask(out, "which shape appeared first ?", at=1.0, seed=3)
    with mmkv.open(out) as pack:
        pieces = list(pack.stream("what color is the circle ?", max_new_tokens=4))
        shares = [m.budget_share for m in mmkv.list_methods()]
    report: mmkv.VerifyReport = mmkv.verify(out)
    names = [model.name for model in mmkv.list_models()] + pieces
    methods.MuKV(k={"patch": 10}, similarity="dot")
    methods.HERMES(deep_share="deep")  # type: ignore[arg-type]
    methods.SnapKV(similarity="dot")  # type: ignore[call-arg]
    methods.ReKV(similarity="euclid")  # type: ignore[arg-type]
    mmkv.ask(out, "?", temperature="hot")  # type: ignore[call-overload]
    return [str(deep), info.method, answer.answer, str(report.ok), str(shares), *names]
