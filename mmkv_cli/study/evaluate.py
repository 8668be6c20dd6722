"""`mmkv eval`: encode each clip once per method and budget, answer its questions from the pack,
score.

Runs land in OUT/<model>/<method>-b<budget>/ (predictions.jsonl, metrics.json, config.json); a run
that stops part-way resumes from its predictions, clip by clip. Scoring is deterministic: exact
match on the normalised answer, or the option letter for multiple choice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mmkv_cli.errors import UsageError
from mmkv_cli.options import (
    AskOptions,
    EncodeOptions,
    GenerationOptions,
    LoadOptions,
    Positions,
)
from mmkv_cli.study.eval_sets.items import LETTERS, Item, correct, normalise, predicted
from mmkv_cli.study.eval_sets.readers import TASKS, load_items
from mmkv_cli.study.runs import open_run, questions_digest, run_folder, work_folder

__all__ = ["TASKS", "Item", "evaluate", "load_items", "normalise", "predicted", "prompt_for"]

# (a run's label, its clip count) -> what to call with the clips done so far; the surface that
# runs the eval draws it (the CLI: a progress bar)
RunProgress = Callable[[str, int], Callable[[int], None]]


def prompt_for(item: Item) -> str:
    if not item.options:
        return item.question
    listed = " ".join(f"{LETTERS[i]} . {o}" for i, o in enumerate(item.options))
    return f"{item.question} options : {listed} . answer with the option letter ."


def kept_share(info: dict) -> float | None:
    """Visual KV a pack holds over the stream's, averaged over layers: the budget as measured, which
    can differ from the one asked for (a method's floors, a token budget, views that overlap)."""
    total, layers = info.get("visual_tokens_total"), info.get("layers") or []
    if not total or not layers:
        return None
    return round(sum(layer["tokens_kept"] for layer in layers) / (len(layers) * total), 4)


def metrics(rows: list[dict], chance: Callable[[str, int], float | None]) -> dict:
    by_type: dict[str, dict] = {}
    for r in rows:
        t = by_type.setdefault(
            r["type"], {"n": 0, "correct": 0, "chance": chance(r["type"], r["options"])}
        )
        t["n"] += 1
        t["correct"] += int(r["correct"])
    for t in by_type.values():
        t["accuracy"] = t["correct"] / t["n"]
    n = len(rows)
    shares = [r["kept"] for r in rows if r.get("kept") is not None]
    return {
        "n": n,
        "accuracy": sum(int(r["correct"]) for r in rows) / n if n else 0.0,
        "kept": round(sum(shares) / len(shares), 4) if shares else None,
        "by_type": by_type,
    }


def chance_level(kind: str, options: int) -> float | None:
    """Uniform guessing: 1/options for multiple choice, the synthetic worlds' answer space for
    their types."""
    from mmkv_cli.study.synth.grid import GRID_QUESTION_TYPES, grid_chance

    if options:
        return 1 / options
    return grid_chance(kind) if kind in GRID_QUESTION_TYPES else None


FINGERPRINT = ("family", "config_sha256", "weights_sha256")  # what makes the model this model


@dataclass(frozen=True)
class EvalSettings:
    """What every run of an eval shares."""

    fps: float | None = None
    max_frames: int | None = None
    positions: Positions | None = None
    max_new_tokens: int = 8
    kv_bits: int = 16  # bits per stored visual K/V value (16: as computed)
    # replay: encode the whole clip, ask with --at; stream: answer each question when the stream
    # reaches its moment, from the memory then (stream_protocol.py); auto: stream when the
    # questions carry moments
    protocol: str = "auto"
    budget_tokens: tuple[int, ...] = ()  # fixed memories (tokens per layer), beside the shares


PROTOCOLS = ("auto", "replay", "stream")


@dataclass(frozen=True)
class Level:
    """A run's budget: a share of the visual tokens, a token count, or none (keeps everything)."""

    share: float | None = None
    tokens: int | None = None

    @property
    def budget(self) -> float | None:
        """As results and run configs report it: the share, 1 for keeping everything, None for a
        token count."""
        return None if self.tokens is not None else (self.share or 1.0)

    @property
    def label(self) -> str:
        return f"t{self.tokens}" if self.tokens is not None else f"b{self.share or 1:g}"


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
) -> dict:
    """Every method at every budget (methods that keep everything once) over the question set.
    fresh: drop the answers earlier runs left in these run folders (else they are reused, when
    made under the same settings, and the run refused when not). progress: told of each run
    as it starts, and of its clips as they are done."""
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
        for level in [Level()] if choice.method.keeps_all else levels:
            plan.append((name, level, _protocol(settings.protocol, choice, level, moments)))
    model = load.model or default_model()
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{root} is a file: --out names the folder results go to")
    backbone = load_backbone(load)
    runs = []
    clips = len({i.video for i in items})
    for name, level, protocol in plan:
        on_clip = progress(f"{name} {level.label} {protocol}", clips) if progress else None
        folder = run_folder(root, model, name, level.label, settings.kv_bits, protocol)
        run = replace(settings, protocol=protocol)
        runs.append(
            evaluate_run(
                items, folder, backbone, model, name, level, run, on_clip=on_clip, fresh=fresh
            )
        )
    figure = run_folder(root, model, "x", "b1").parent / "accuracy_vs_budget.png"
    plot(runs, figure)
    return {"runs": runs, "plot": str(figure)}


def _protocol(asked: str, choice, level: Level, moments: bool) -> str:
    """A run's protocol: as asked (a stream refuses, before any work, a budget that needs the
    stream's length), or for auto: stream where the questions carry moments and the budget can
    follow a stream, else replay."""
    from mmkv_cli.encode.live import check_live

    if asked == "replay" or (asked == "auto" and not moments):
        return "replay"
    try:
        check_live(choice.with_budget(level.share, level.tokens))
    except UsageError:
        if asked == "stream":
            raise
        return "replay"
    return "stream"


def evaluate_run(
    items: list[Item],
    folder: Path,
    backbone,
    model: str,
    method: str,
    level: Level,
    settings: EvalSettings,
    on_clip: Callable[[int], None] | None = None,
    fresh: bool = False,
) -> dict:
    """One method at one budget (Level(): its own, for methods that keep everything) over every
    item; resumes from folder/predictions.jsonl."""
    config = _run_config(items, backbone, model, method, level, settings)
    done = open_run(folder, config, fresh)
    clips: dict[str, list[Item]] = {}
    for item in items:
        clips.setdefault(item.video, []).append(item)
    answer = _answer_streamed if settings.protocol == "stream" else _answer_clip
    with (folder / "predictions.jsonl").open("a") as sink, work_folder(folder) as tmp:
        for n, (video, asked) in enumerate(clips.items()):
            todo = [i for i in asked if i.key not in done]
            if todo:
                pack = Path(tmp) / "clip.kvpack"
                for row in answer(video, todo, pack, backbone, method, level, settings):
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    done[row["key"]] = row
            if on_clip:
                on_clip(n + 1)
    result = {
        "method": method,
        "budget": level.budget,
        "budget_tokens": level.tokens,
        "protocol": settings.protocol,
        "kv_bits": settings.kv_bits,
        **metrics(_scored(items, done), chance_level),
    }
    (folder / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _run_config(items, backbone, model, method, level: Level, settings: EvalSettings) -> dict:
    """Everything a run's answers depend on: a run folder is reused only under the same."""
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.spec import as_plain

    fingerprint = backbone.fingerprint()
    config = {
        "model": model,
        "model_fingerprint": {k: fingerprint.get(k) for k in FINGERPRINT},
        "method": method,
        "params": as_plain(resolve_method(method).params),
        "budget": level.budget,
        "fps": settings.fps,
        "max_frames": settings.max_frames,
        "positions": settings.positions.value if settings.positions else None,
        "max_new_tokens": settings.max_new_tokens,
        "kv_bits": settings.kv_bits,
        "questions_sha256": questions_digest(items),
    }
    if level.tokens is not None:  # keys a replay run at a share never had: its folder still fits
        config["budget_tokens"] = level.tokens
    if settings.protocol == "stream":
        config["protocol"] = "stream"
    return config


def _row(item: Item, video: str, answer, kept) -> dict:
    guess = predicted(item, answer.answer)
    return {
        "key": item.key,
        "video": video,
        "question": item.question,
        "type": item.type,
        "options": len(item.options),
        "answer": item.answer,
        "prediction": guess,
        "raw": answer.answer,
        "correct": correct(item, guess),
        "context_tokens": answer.context_tokens,
        "ttft_s": round(answer.ttft_s, 4),
        "kept": kept,
    }


def _answer_clip(video, todo, pack, backbone, method, level: Level, settings: EvalSettings):
    """Replay: encode one clip once, then answer each of its questions from the pack (at its
    moment, with --at): a row per item."""
    from mmkv_cli import api

    encoding = EncodeOptions(
        method,
        level.share,
        level.tokens,
        fps=settings.fps,
        max_frames=settings.max_frames,
        force=True,
        kv_bits=settings.kv_bits,
    )
    info = api.encode(video, pack, encoding, backbone=backbone)
    kept = kept_share(info)
    generation = GenerationOptions(max_new_tokens=settings.max_new_tokens)
    for item in todo:
        asking = AskOptions(at=item.at, positions=settings.positions, generation=generation)
        answer = api.ask(pack, prompt_for(item), asking, backbone=backbone)
        yield _row(item, video, answer, kept)


def _answer_streamed(video, todo, pack, backbone, method, level: Level, settings: EvalSettings):
    """Stream: the clip followed once as a live stream, each question answered from the memory at
    its moment (stream_protocol.py): a row per item."""
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.study.stream_protocol import answered_live

    choice = resolve_method(method).with_budget(level.share, level.tokens)
    generation = GenerationOptions(max_new_tokens=settings.max_new_tokens)
    asking = AskOptions(positions=settings.positions, generation=generation)
    fps = settings.fps if settings.fps is not None else backbone.spec.fps
    frames = settings.max_frames if settings.max_frames is not None else backbone.spec.max_frames
    for item, answer, info in answered_live(
        video, todo, backbone, choice, fps, frames, settings.kv_bits, asking, prompt_for
    ):
        yield _row(item, video, answer, kept_share(info))


def _scored(items: list[Item], done: dict) -> list[dict]:
    """The answered items scored against the gold answers as they are now, whatever they were
    when answered."""
    rows = []
    for i in items:
        if i.key in done:
            guess = predicted(i, done[i.key]["raw"])
            rows.append({**done[i.key], "answer": i.answer, "prediction": guess})
            rows[-1]["correct"] = correct(i, guess)
    return rows


def _series(run: dict) -> str:
    """A plot line: a method, under one protocol and one kind of budget."""
    kind = " tokens" if run.get("budget_tokens") else ""
    stream = " (stream)" if run.get("protocol") == "stream" else ""
    return f"{run['method']}{kind}{stream}"


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
    ax.set_xscale("log")
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
