"""`mmkv.eval`: accuracy against budget over a question set, as `mmkv eval` runs it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mmkv._results import EvalResult
from mmkv_cli.core.errors import called_from_python
from mmkv_cli.core.options import LoadOptions, kv_bits_value


@called_from_python()
def eval(  # noqa: A001 (mmkv.eval, as `mmkv eval`)
    questions: str | Path,
    out: str | Path,
    *,
    methods: Sequence[str] = ("full", "recency"),
    budgets: Sequence[float] | None = None,
    budget_tokens: Sequence[int] = (),
    model: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    task: str | None = None,
    media: str | Path | None = None,
    protocol: str = "auto",
    max_new_tokens: int = 8,
    kv_bits: float | None = None,
    fps: float | None = None,
    max_frames: int | None = None,
    limit: int | None = None,
    fresh: bool = False,
) -> EvalResult:
    """Accuracy against budget: every method at every budget over a question set, each clip
    encoded once per run; results and a plot go to the folder `out` (as `mmkv eval`).

    Args:
        questions: the question set (mmkv JSONL, MLVU, Video-MME, EgoSchema, OVO-Bench or
            MMLongBench-Doc; `task` names the format when the file does not).
        methods: methods or presets by name.
        budgets: shares of visual tokens kept (None: 0.5 and 0.1 unless budget_tokens).
        budget_tokens: fixed memories, in visual tokens per layer.
        media: the folder holding the videos or PDFs (None: the file's folder).
        protocol: replay, stream or auto (stream where questions carry moments).
        limit: only the first N questions; fresh: drop the answers earlier runs left in `out`.
        The rest: as `encode` and `ask`.
    """
    from mmkv_cli.study.eval_run import EvalSettings
    from mmkv_cli.study.evaluate import evaluate

    settings = EvalSettings(
        fps=fps,
        max_frames=max_frames,
        max_new_tokens=max_new_tokens,
        kv_bits=kv_bits_value(kv_bits) if kv_bits is not None else None,
        protocol=protocol,
        budget_tokens=tuple(budget_tokens),
    )
    load = LoadOptions(model=model, device=device, dtype=dtype)
    result = evaluate(
        str(questions),
        list(methods),
        list(budgets if budgets is not None else () if budget_tokens else (0.5, 0.1)),
        out,
        settings,
        load,
        limit,
        fresh,
        task,
        None if media is None else str(media),
    )
    return EvalResult(runs=result["runs"], plot=result["plot"])
