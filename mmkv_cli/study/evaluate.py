"""`mmkv eval`: encode each clip once per method and budget, answer its questions from the pack,
score.

Runs land in OUT/<model>/<method>-b<budget>/ (predictions.jsonl, metrics.json, config.json); a run
that stops part-way resumes from its predictions, clip by clip. Scoring is deterministic: exact
match on the normalised answer, or the option letter for multiple choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from mmkv_cli.cluster.pool import Cluster
from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import LoadOptions
from mmkv_cli.study.eval_run import (
    PROTOCOLS,
    EvalSettings,
    Level,
    PlannedRun,
    chance_level,
    evaluate_run,
    kept_share,
    metrics,
    prompt_for,
)
from mmkv_cli.study.eval_sets.items import Item, normalise, predicted
from mmkv_cli.study.eval_sets.readers import TASKS, load_items
from mmkv_cli.study.runs import run_folder

__all__ = [
    "TASKS",
    "Cluster",
    "EvalSettings",
    "Item",
    "Level",
    "chance_level",
    "evaluate",
    "kept_share",
    "load_items",
    "metrics",
    "normalise",
    "predicted",
    "prompt_for",
]

# (a run's label, its clip count) -> what to call with the clips done so far; the surface that
# runs the eval draws it (the CLI: a progress bar)
RunProgress = Callable[[str, int], Callable[[int], None]]


def evaluate(
    qa_file: str,
    methods: list[str],
    budgets: list[float],
    out: str | Path,
    settings: EvalSettings,
    load: LoadOptions,
    limit: int | None = None,
    fresh: bool = False,
    task: str | None = None,
    media: str | None = None,
    progress: RunProgress | None = None,
    cluster: Cluster | None = None,
) -> dict:
    """Every method at every budget (methods that keep everything once) over the question set.
    fresh: drop the answers earlier runs left in these run folders (else they are reused, when
    made under the same settings, and the run refused when not). progress: told of each run
    as it starts, and of its clips as they are done. cluster: the videos on Ray actors, each video
    with all its questions for every run one work item (eval_ray.py)."""
    from mmkv_cli.backbones.loading import load_backbone
    from mmkv_cli.backbones.spec import default_model
    from mmkv_cli.methods.choice import check_budget, resolve_method

    if settings.protocol not in PROTOCOLS:
        raise UsageError(f"unknown protocol '{settings.protocol}' ({', '.join(PROTOCOLS)})")
    levels = [Level(share=check_budget(b)) for b in budgets]
    for tokens in settings.budget_tokens:
        if tokens < 1:
            raise UsageError(f"--budget-tokens must be at least 1, got {tokens}")
        levels.append(Level(tokens=tokens))
    items = load_items(qa_file, task, media)[:limit]
    if not items:
        raise UsageError(f"{qa_file} holds no questions")
    moments = any(i.at is not None for i in items)
    plan = []
    for name in methods:
        choice = resolve_method(name)  # unknown names fail here, before any work
        for level in levels if choice.method.takes_budget else [Level()]:
            plan.append((name, level, _protocol(settings.protocol, choice, level, moments)))
    model = load.model or default_model()
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root} is a file: --out names the folder results go to")
    planned = [
        PlannedRun(name, level, replace(settings, protocol=protocol), model, root)
        for name, level, protocol in plan
    ]
    extra: dict = {}
    if cluster is not None:
        from mmkv_cli.study.eval_ray import evaluate_on_ray

        runs, extra = evaluate_on_ray(items, planned, load, cluster, fresh, progress)
    else:
        backbone = load_backbone(load)
        runs = []
        clips = len({i.video for i in items})
        for run in planned:
            on_clip = progress(run.label, clips) if progress else None
            runs.append(evaluate_run(items, run, backbone, on_clip=on_clip, fresh=fresh))
    figure = run_folder(root, model, "x", "b1").parent / "accuracy_vs_budget.png"
    plot(runs, figure)
    return {"runs": runs, "plot": str(figure), **extra}


def _protocol(asked: str, choice, level: Level, moments: bool) -> str:
    """A run's protocol: as asked (a stream refuses, before any work, a budget that needs the
    stream's length), or for auto: stream where the questions carry moments and the budget can
    follow a stream, else replay."""
    from mmkv_cli.methods.choice import check_live

    if asked == "replay" or (asked == "auto" and not moments):
        return "replay"
    try:
        check_live(choice.with_budget(level.share, level.tokens))
    except UsageError:
        if asked == "stream":
            raise
        return "replay"
    return "stream"


def _series(run: dict) -> str:
    """A plot line: a method, under one protocol and one kind of budget."""
    kind = " tokens" if run.get("budget_tokens") else ""
    stream = " (stream)" if run.get("protocol") == "stream" else ""
    return f"{run['method']}{kind}{stream}"


SHARE_TICKS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)


def share_axis(ax) -> None:
    """A log x axis of shares labelled as plain numbers (0.1, 0.5), not as powers of ten: a
    range within one decade otherwise gets only minor labels such as 4x10^-1."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(SHARE_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, label in enumerate(dict.fromkeys(_series(r) for r in runs)):
        # x: the share of visual KV the packs held, as measured (a token budget has no share)
        points = sorted(
            (r["kept"] if r.get("kept") is not None else r["budget"] or 1.0, r["accuracy"])
            for r in runs
            if _series(r) == label
        )
        whole = [r for r in runs if _series(r) == label and r.get("budget") == 1.0]
        if len(points) == 1 and whole:  # keeps everything: a level to compare the others with
            ax.axhline(
                points[0][1], linestyle=":", color=f"C{i % 10}", label=f"{label} (keeps all)"
            )
        else:
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                color=f"C{i % 10}",
                label=label,
            )
    chances = [t["chance"] * t["n"] for t in runs[0]["by_type"].values() if t["chance"] is not None]
    if runs and len(chances) == len(runs[0]["by_type"]):
        ax.axhline(sum(chances) / runs[0]["n"], color="gray", linestyle="--", label="chance")
    share_axis(ax)
    ax.set_xlabel("fraction of visual KV kept (measured)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".part.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
