"""One eval run (a method at a budget under a protocol) over a question set: its settings, its
folder's config, each video answered (encode then ask, or followed as a stream), and its figures.
`mmkv eval` (evaluate.py) plans the runs and drives them, here or on Ray (eval_ray.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmkv_cli.core.options import AskOptions, EncodeOptions, GenerationOptions, Positions
from mmkv_cli.study.eval_sets.items import LETTERS, Item, correct, predicted
from mmkv_cli.study.runs import open_run, questions_digest, run_folder, work_folder


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
    by_split: dict[str, dict] = {}  # the benchmark's own parts, where it defines them
    for r in rows:
        if r.get("split"):
            part = by_split.setdefault(r["split"], {"n": 0, "correct": 0})
            part["n"] += 1
            part["correct"] += int(r["correct"])
    for part in by_split.values():
        part["accuracy"] = part["correct"] / part["n"]
    n = len(rows)
    return {
        "n": n,
        "accuracy": sum(int(r["correct"]) for r in rows) / n if n else 0.0,
        **{key: _mean(rows, key) for key in ("kept", "prefilled", "kv_bytes", "encode_s")},
        "by_type": by_type,
        **({"by_split": by_split} if by_split else {}),
    }


def _mean(rows: list[dict], key: str) -> float | None:
    """The rows' mean of `key`, over those that have it (answers of older runs lack the newer)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(sum(values) / len(values), 4) if values else None


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
    # bits per stored visual K/V value (16: as computed; options.KV_BITS); None: each method's own
    kv_bits: float | None = None
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


def bits_of(method: str, settings: EvalSettings) -> int | float:
    """The bits a run stores at: the eval's, else the method's own."""
    from mmkv_cli.core.options import given_or_own_bits
    from mmkv_cli.methods.choice import resolve_method

    return given_or_own_bits(settings.kv_bits, resolve_method(method).method)


@dataclass(frozen=True)
class PlannedRun:
    """One method at one budget under one protocol: where its answers go."""

    method: str
    level: Level
    settings: EvalSettings  # with the run's own protocol
    model: str
    root: Path

    @property
    def label(self) -> str:
        return f"{self.method} {self.level.label} {self.settings.protocol}"

    @property
    def folder(self) -> Path:
        s = self.settings
        return run_folder(
            self.root, self.model, self.method, self.level.label, self.bits, s.protocol
        )

    @property
    def bits(self) -> int | float:
        return bits_of(self.method, self.settings)


def evaluate_run(
    items: list[Item],
    run: PlannedRun,
    backbone,
    on_clip: Callable[[int], None] | None = None,
    fresh: bool = False,
) -> dict:
    """One method at one budget (Level(): its own, for methods that keep everything) over every
    item; resumes from its folder's predictions.jsonl."""
    folder = run.folder
    done = open_run(folder, run_config(items, backbone.fingerprint(), run), fresh)
    clips: dict[str, list[Item]] = {}
    for item in items:
        clips.setdefault(item.video, []).append(item)
    with (folder / "predictions.jsonl").open("a") as sink, work_folder(folder) as tmp:
        for n, (video, asked) in enumerate(clips.items()):
            todo = [i for i in asked if i.key not in done]
            if todo:
                pack = Path(tmp) / "clip.kvpack"
                for row in answer_video(video, todo, pack, backbone, run):
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    done[row["key"]] = row
            if on_clip:
                on_clip(n + 1)
    return run_result(items, done, run)


def answer_video(video: str, todo: list[Item], pack: Path, backbone, run: PlannedRun):
    """A row per question of `todo` about `video`, by the run's protocol."""
    answer = _answer_streamed if run.settings.protocol == "stream" else _answer_clip
    return answer(video, todo, pack, backbone, run.method, run.level, run.settings)


def run_result(items: list[Item], done: dict, run: PlannedRun) -> dict:
    """A run's figures over the answers it holds, written to its metrics.json."""
    result = {
        "method": run.method,
        "budget": run.level.budget,
        "budget_tokens": run.level.tokens,
        "protocol": run.settings.protocol,
        "kv_bits": run.bits,
        **metrics(_scored(items, done), chance_level),
    }
    (run.folder / "metrics.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_config(items: list[Item], fingerprint: dict, run: PlannedRun) -> dict:
    """Everything a run's answers depend on (the model's fingerprint among them): a run folder is
    reused only under the same."""
    from mmkv_cli.core.spec import as_plain
    from mmkv_cli.methods.choice import resolve_method

    method, level, settings = run.method, run.level, run.settings
    config = {
        "model": run.model,
        "model_fingerprint": {k: fingerprint.get(k) for k in FINGERPRINT},
        "method": method,
        "params": as_plain(resolve_method(method).params),
        "budget": level.budget,
        "fps": settings.fps,
        "max_frames": settings.max_frames,
        "positions": settings.positions.value if settings.positions else None,
        "max_new_tokens": settings.max_new_tokens,
        "kv_bits": run.bits,
        "questions_sha256": questions_digest(items),
    }
    if level.tokens is not None:  # keys a replay run at a share never had: its folder still fits
        config["budget_tokens"] = level.tokens
    if settings.protocol == "stream":
        config["protocol"] = "stream"
    return config


def _row(item: Item, video: str, answer, info: dict) -> dict:
    guess = predicted(item, answer.answer)
    total = info.get("visual_tokens_total") or 0
    return {
        "key": item.key,
        "video": video,
        "question": item.question,
        "type": item.type,
        **({"split": item.split} if item.split else {}),
        "options": len(item.options),
        "answer": item.answer,
        "prediction": guess,
        "raw": answer.answer,
        "correct": correct(item, guess),
        "context_tokens": answer.context_tokens,
        "ttft_s": round(answer.ttft_s, 4),
        "kept": kept_share(info),
        # what the encode cost and left: tokens prefilled (after any reducer), the pack's KV bytes,
        # the encode's seconds (a replay's; a stream's is spread over its moments)
        "prefilled": round(info.get("visual_tokens_prefilled", total) / total, 4)
        if total
        else None,
        "kv_bytes": info.get("kv_bytes"),
        "encode_s": info.get("encode_s"),
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
        kv_bits=settings.kv_bits,  # None: the method's own, as the run's folder names it
    )
    info = api.encode(video, pack, encoding, backbone=backbone)
    generation = GenerationOptions(max_new_tokens=settings.max_new_tokens)
    for item in todo:
        asking = AskOptions(at=item.at, positions=settings.positions, generation=generation)
        answer = api.ask(pack, prompt_for(item), asking, backbone=backbone)
        yield _row(item, video, answer, info)


def _answer_streamed(video, todo, pack, backbone, method, level: Level, settings: EvalSettings):
    """Stream: the clip followed once as a live stream, each question answered from the memory at
    its moment (stream_protocol.py): a row per item."""
    from mmkv_cli.core.options import given_or_own_bits
    from mmkv_cli.methods.choice import resolve_method
    from mmkv_cli.study.stream_protocol import answered_live

    choice = resolve_method(method).with_budget(level.share, level.tokens)
    generation = GenerationOptions(max_new_tokens=settings.max_new_tokens)
    asking = AskOptions(positions=settings.positions, generation=generation)
    fps = settings.fps if settings.fps is not None else backbone.spec.fps
    frames = settings.max_frames if settings.max_frames is not None else backbone.spec.max_frames
    bits = given_or_own_bits(settings.kv_bits, choice.method)
    for item, answer, info in answered_live(
        video, todo, backbone, choice, fps, frames, bits, asking, prompt_for
    ):
        yield _row(item, video, answer, info)


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
