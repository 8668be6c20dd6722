"""Annotation formats `mmkv eval` reads, each into Items. `--task` names one; otherwise the file
tells (its suffix, its name, the keys of its first record). Media paths resolve against --media
(default: the annotation file's folder). Every reader refuses a malformed record with its place."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from mmkv_cli.core.errors import UsageError
from mmkv_cli.study.eval_sets.items import Item, make_item, strip_letter

VIDEO_SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov")
MAX_BYTES = 512 << 20  # an annotation file larger than this is not one


def _records(path: Path) -> list:
    """A JSON list (or one object), a JSONL file, or a parquet table (needs pyarrow), as dicts."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
            ) from None
        return pq.read_table(path).to_pylist()
    if path.stat().st_size > MAX_BYTES:
        raise UsageError(f"{path} is over {MAX_BYTES >> 20} MiB: not an annotation file")
    text = path.read_text(encoding="utf-8-sig")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deep") from None
    return data if isinstance(data, list) else [data]


def _media(folder: Path, name: str) -> Path:
    """`name` under the media folder; a bare id gets the first video suffix that exists."""
    path = folder / str(name)
    if path.suffix or path.exists():
        return path
    for suffix in VIDEO_SUFFIXES:
        if path.with_suffix(suffix).exists():
            return path.with_suffix(suffix)
    return path.with_suffix(".mp4")


def read_mmkv(path: Path, media: Path) -> list[Item]:
    """mmkv's own JSONL: {video, question, answer, options?, at? (or timestamp), type?, format?}."""
    return [
        make_item(
            media / r["video"],
            r["question"],
            r["answer"],
            r.get("options"),
            r.get("at", r.get("timestamp")),
            r.get("type"),
            r.get("format", "text"),
        )
        for r in _records(path)
    ]


def read_mlvu(path: Path, media: Path) -> list[Item]:
    """MLVU as ReKV ships it: [{video_id, video_path, conversations: [{question, choices,
    answer, question_type?}]}]."""
    return [
        make_item(
            video,
            turn["question"],
            turn["answer"],
            turn.get("choices"),
            turn.get("at", turn.get("timestamp")),
            turn.get("question_type", entry.get("question_type")),
        )
        for video, entry, turn in _turns(path, media)
    ]


def _turns(path: Path, media: Path):
    """(video, entry, turn) for every conversation turn of a [{video_path or video_id,
    conversations: [...]}] file (MLVU as ReKV ships it, RVS)."""
    for entry in _records(path):
        video = media / entry.get("video_path", entry.get("video_id", ""))
        for turn in entry["conversations"]:
            yield video, entry, turn


def read_videomme(path: Path, media: Path) -> list[Item]:
    """Video-MME (the parquet table, or JSON/JSONL of its rows): videoID names the video file,
    options carry their letters ("A. ..."), answer is a letter; scored by duration."""
    return [
        make_item(
            _media(media, r["videoID"]),
            r["question"],
            r["answer"],
            [strip_letter(o) for o in r["options"]],
            None,
            r.get("duration"),
        )
        for r in _records(path)
    ]


def read_egoschema(path: Path, media: Path, answers: Path | None = None) -> list[Item]:
    """EgoSchema: questions.json [{q_uid, question, "option 0".."option 4"}] with the public
    answers in subset_answers.json ({q_uid: index}) beside it; only answered questions count."""
    answers = answers or path.with_name("subset_answers.json")
    if not answers.is_file():
        raise UsageError(f"EgoSchema needs its answers: no {answers} (subset_answers.json)")
    try:
        gold = json.loads(answers.read_text(encoding="utf-8"))
    except (ValueError, RecursionError):
        raise UsageError(f"{answers}: not JSON") from None
    if not isinstance(gold, dict):
        raise UsageError(f"{answers} is not a {{q_uid: answer index}} mapping")
    items = []
    for r in _records(path):
        if r["q_uid"] not in gold:
            continue
        options = [r[f"option {i}"] for i in range(5)]
        answer = gold[r["q_uid"]]
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise UsageError(f"{answers}: the answer to {r['q_uid']} is not an option index")
        items.append(
            make_item(_media(media, r["q_uid"]), r["question"], answer, options, None, "egoschema")
        )
    return items


# OVO-Bench's three parts by task (its paper's table): what was seen before the question,
# what is on screen at it, and what only later frames answer
OVO_SPLITS = {
    **dict.fromkeys(("EPM", "ASI", "HLD"), "backward"),
    **dict.fromkeys(("STU", "OJR", "ATR", "ACR", "OCR", "FPD"), "real-time"),
    **dict.fromkeys(("REC", "SSR", "CRR"), "forward"),
}


def read_ovobench(path: Path, media: Path) -> list[Item]:
    """OVO-Bench: [{id, task, video, realtime, question, options, answer}]; `realtime` is the
    question's moment (seconds), so only what was seen by then answers it. Each task counts in
    its part: backward, real-time or forward."""
    return [
        make_item(
            media / r["video"],
            r["question"],
            r["answer"],
            r["options"],
            r["realtime"],
            r["task"],
            split=OVO_SPLITS.get(r["task"]),
        )
        for r in _records(path)
    ]


# StreamingBench's parts by task_type (its paper's three groups); omni-source questions need the
# sound, which mmkv does not read: they are scored on the frames alone
STREAMINGBENCH_SPLITS = {
    **dict.fromkeys(
        (
            "Object Recognition",
            "Attribute Recognition",
            "Text-Rich Understanding",
            "Counting",
            "Action Recognition",
            "Spatial Understanding",
            "Event Understanding",
            "Causal Reasoning",
            "Clips Summarize",
            "Prospective Reasoning",
        ),
        "real-time",
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "Emotion Recognition",
            "Scene Understanding",
            "Source Discrimination",
            "Multimodal Alignment",
        ),
        "omni-source",
    ),  # fmt: skip
    **dict.fromkeys(
        ("Misleading Context Understanding", "Anomaly Context Understanding"), "contextual"
    ),
}


def clock_seconds(stamp) -> float:
    """'00:03:10' (or '3:10', or a number) as seconds."""
    if isinstance(stamp, int | float) and not isinstance(stamp, bool):
        return float(stamp)
    parts = str(stamp).strip().split(":")
    if not 1 <= len(parts) <= 3 or not all(p.replace(".", "", 1).isdigit() for p in parts):
        raise ValueError(f"time_stamp {str(stamp)[:20]!r} is not HH:MM:SS")
    return sum(float(p) * 60**i for i, p in enumerate(reversed(parts)))


def read_streamingbench(path: Path, media: Path) -> list[Item]:
    """StreamingBench (its src/data/questions_real.json, questions_omni.json): [{time,
    video_path, video_categories, questions: [{task_type, question, time_stamp "HH:MM:SS",
    options ["A. ...", ...], answer letter, required_ability}]}]. A question is asked at its
    time_stamp over the video up to it, as its eval does; its task_type is its type, and its part
    (real-time, omni-source, contextual) its split. Proactive-output records (no options, a time
    to answer at) and the sequential-QA file are another protocol: refused."""
    items = []
    for entry in _records(path):
        video = media / entry["video_path"]
        for turn in entry["questions"]:
            if "options" not in turn:
                raise UsageError(
                    f"{path}: '{turn['task_type']}' asks when to answer, not what: mmkv eval "
                    "scores multiple-choice questions (questions_real.json, questions_omni.json)"
                )
            items.append(
                make_item(
                    video,
                    turn["question"],
                    turn["answer"],
                    [strip_letter(o) for o in turn["options"]],
                    clock_seconds(turn["time_stamp"]),
                    turn["task_type"],
                    split=STREAMINGBENCH_SPLITS.get(turn["task_type"]),
                )
            )
    return items


def read_rvs(path: Path, media: Path) -> list[Item]:
    """RVS-Ego and RVS-Movie (Flash-VStream's realtime VideoQA sets, as HERMES ships them):
    [{video_id, video_path, duration?, conversations: [{question, answer, start_time, end_time}]}];
    each question is asked at its end_time, open-ended (scored by normalised match: the papers'
    scores come from a GPT judge, which mmkv does not run). Files of this shape whose turns carry
    choices (HERMES' converted StreamingBench and OVO-Bench) are scored by letter, their task as
    the type."""
    return [
        make_item(
            video,
            turn["question"],
            turn["answer"],
            turn.get("choices"),
            turn["end_time"],
            turn.get("task", entry.get("task", "rvs")),
        )
        for video, entry, turn in _turns(path, media)
    ]


def read_mmlongbench_doc(path: Path, media: Path) -> list[Item]:
    """MMLongBench-Doc: samples.json [{doc_id, question, answer, answer_format}] over PDFs.
    Int/Float/Str by exact match (floats within 1%), List as a set of items, and "None" (not
    answerable) scores when the answer says so."""
    kinds = {"str": "text", "int": "int", "float": "float", "list": "list", "none": "none"}
    items = []
    for r in _records(path):
        fmt = str(r.get("answer_format", "Str")).strip().lower()
        if fmt not in kinds:
            raise UsageError(f"{path}: unknown answer_format {r.get('answer_format')!r}")
        items.append(
            make_item(media / r["doc_id"], r["question"], r["answer"], None, None, fmt, kinds[fmt])
        )
    return items


TASKS: dict[str, Callable[[Path, Path], list[Item]]] = {
    "mmkv": read_mmkv,
    "mlvu": read_mlvu,
    "videomme": read_videomme,
    "egoschema": read_egoschema,
    "ovobench": read_ovobench,
    "streamingbench": read_streamingbench,
    "rvs": read_rvs,
    "mmlongbench-doc": read_mmlongbench_doc,
}
# the key of a first record that tells a format apart from the others
TELLTALES = (
    ("questions", "streamingbench"),
    ("conversations", "mlvu"),
    ("videoID", "videomme"),
    ("q_uid", "egoschema"),
    ("realtime", "ovobench"),
    ("doc_id", "mmlongbench-doc"),
    ("video", "mmkv"),
)


def detect(path: Path) -> str:
    if path.suffix == ".parquet":
        return "videomme"
    records = _records(path)
    first = records[0] if records and isinstance(records[0], dict) else {}
    turns = first.get("conversations")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "end_time" in turns[0]:
        return "rvs"  # conversations asked at moments: RVS (or HERMES' converted sets)
    for key, task in TELLTALES:
        if key in first:
            return task
    raise UsageError(f"{path}: cannot tell its format; name it with --task ({', '.join(TASKS)})")


def load_items(path: str | Path, task: str | None = None, media: str | Path | None = None):
    """The questions of `path` read as `task` (None: detected), media under `media` (None: the
    file's folder)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"no question file at {path}")
    if task is not None and task not in TASKS:
        raise UsageError(f"unknown --task {task!r} (known: {', '.join(TASKS)})")
    folder = Path(media) if media is not None else path.parent
    if media is not None and not folder.is_dir():
        raise UsageError(f"--media: no such folder: {folder}")
    try:
        return TASKS[task or detect(path)](path, folder)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        name = task or "its"
        raise UsageError(f"{path} is not in {name} format ({type(err).__name__}: {err})") from None
