"""`mmkv ask`: questions to a pack, or (each line of a questions file naming its pack) to many
packs, here or on Ray workers."""

from __future__ import annotations

from dataclasses import replace

import typer

from mmkv_cli.cli.common import (
    CpusPerWorkerOpt,
    DeviceOpt,
    DtypeOpt,
    GpusPerWorkerOpt,
    JsonLinesOpt,
    PackModelOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    TopPOpt,
    WorkersOpt,
    emit_json,
    load_options,
    ray_option,
    run,
)
from mmkv_cli.cli.server import NoServerOpt, open_session
from mmkv_cli.cluster.pool import Cluster
from mmkv_cli.core.errors import MmkvError, UsageError
from mmkv_cli.core.options import (
    AskOptions,
    Dtype,
    GenerationOptions,
    LoadOptions,
    Positions,
    check_ask,
)


def ask(
    pack: str | None = typer.Argument(
        None, help="A .kvpack written by `mmkv encode` (optional when each line names its pack)."
    ),
    questions: list[str] | None = typer.Argument(
        None, help="One or more questions; '-' reads them from stdin, one per line."
    ),
    questions_file: str | None = typer.Option(
        None,
        "--questions",
        help="A file of questions, one per line or JSONL {question, at?, id?, pack?}; '-' for "
        "stdin. Lines naming packs are answered pack by pack, as JSONL in the file's order.",
    ),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Longest answer, in tokens."),
    temperature: float = TemperatureOpt,
    top_p: float = TopPOpt,
    seed: int | None = SeedOpt,
    stop: list[str] | None = StopOpt,
    model: str | None = PackModelOpt,
    explain: bool = typer.Option(
        False, "--explain", help="List the context's blocks, their spans and retrieval scores."
    ),
    at: float | None = typer.Option(
        None, "--at", help="The question's moment (s): only blocks shown by then count."
    ),
    positions: Positions | None = typer.Option(
        None, "--positions", help="Keep the stored positions or compact them (default: method's)."
    ),
    prune: str | None = typer.Option(
        None,
        "--prune",
        metavar="METHOD",
        help="Prune the context's visual KV by the question before decoding, with a method that "
        "prunes at ask (`mmkv methods` names them) or a preset over one.",
    ),
    budget: float | None = typer.Option(
        None, "--prune-budget", "--budget", help="With --prune: share of the visual KV kept."
    ),
    device: str = DeviceOpt,
    dtype: Dtype = DtypeOpt,
    ray: str | None = ray_option("the packs"),
    workers: int = WorkersOpt,
    cpus_per_worker: float = CpusPerWorkerOpt,
    gpus_per_worker: float = GpusPerWorkerOpt,
    no_server: bool = NoServerOpt,
    as_json: bool = JsonLinesOpt,
) -> None:
    """Answer questions from a saved pack, without the media.

    The model loads once for all of them.
    --json prints one JSON object per question (JSONL), in input order."""

    def body() -> None:
        from mmkv_cli.cli.questions import gather

        ignored: set[str] = set()  # the keys of other tools' files (synth's, eval's): told once
        asked = gather(list(questions or []), questions_file, ignored)
        if ignored:
            from mmkv_cli.cli.display import err_console
            from mmkv_cli.cli.literal import plain

            err_console.print(
                plain(
                    f"warning: {questions_file}: ignored the key(s) {', '.join(sorted(ignored))} "
                    "(ask reads question, at, id and pack)"
                ),
                soft_wrap=True,  # one line, however long the path
            )
        generation = GenerationOptions(max_new_tokens, temperature, top_p, seed, tuple(stop or ()))
        options = AskOptions(
            at=at,
            positions=positions,
            prune=prune,
            prune_budget=budget,
            generation=generation,
            explain=explain,
        )
        check_ask(options)  # before the model loads
        if prune is not None:  # the registry is read only when asked for
            from mmkv_cli.methods.choice import check_pruning

            check_pruning(prune)
        if ray is None and workers > 1:
            raise UsageError("--workers > 1 runs on Ray: add --ray local, --ray auto or an address")
        if ray is not None or any(q.pack is not None for q in asked):
            cluster = (
                None if ray is None else Cluster(ray, workers, cpus_per_worker, gpus_per_worker)
            )
            load = load_options(model, device, dtype, here=ray is None)
            failed = _answer_packs(pack, asked, load, options, explain, cluster)
        elif pack is None:
            raise UsageError("give a PACK, or a questions file whose lines name their packs")
        else:
            session = open_session(pack, load_options(model, device, dtype), no_server)
            try:
                failed = _answer_all(session, asked, options, as_json, explain)
            finally:
                session.close()
        if failed:
            raise MmkvError(f"{failed} of {len(asked)} questions failed (see above)")

    run(body)


def _answer_all(session, asked: list, options: AskOptions, as_json: bool, explain: bool) -> int:
    """Answer each question in order, streaming text (or one JSON line each); a question that
    fails reports its one-line error and the others still run. Returns how many failed."""
    from mmkv_cli.ask.result import answer_record
    from mmkv_cli.cli.display import err_console
    from mmkv_cli.cli.literal import literal
    from mmkv_cli.cli.log_lines import answer_broken, answer_end, answer_piece

    failed = 0
    for number, q in enumerate(asked, 1):
        mine = replace(options, at=q.at if q.at is not None else options.at)
        if len(asked) > 1 and not as_json:
            counted = f"[dim]\\[{number}/{len(asked)}][/dim]"
            err_console.print(f"{counted} {literal(q.text)}", highlight=False)
        try:
            answer = session.ask(q.text, mine, on_token=None if as_json else answer_piece)
        except MmkvError as err:
            answer_broken()
            if len(asked) == 1:
                raise
            failed += 1
            if as_json:
                emit_json(
                    {
                        **({"id": q.id} if q.id is not None else {}),
                        "question": q.text,
                        "at": mine.at,
                        "error": str(err),
                    }
                )
            else:
                err_console.print(f"[red]error:[/red] {literal(err)}", highlight=False)
            continue
        if as_json:
            emit_json(answer_record(answer, q.text, mine.at, q.id, explain))
            continue
        answer_end()
        if explain:
            from mmkv_cli.cli.display import show_retrieved

            show_retrieved(answer.retrieved, answer.blocks_used, session.media_kind)
    return failed


def _answer_packs(
    pack: str | None,
    asked: list,
    load: LoadOptions,
    options: AskOptions,
    explain: bool,
    cluster: Cluster | None,
) -> int:
    """Questions naming their packs (or PACK), answered pack by pack, each pack opened once per
    worker, JSONL on stdout in the file's order; on Ray a per-worker summary on stderr. Returns
    how many failed."""
    from mmkv_cli.batch.questions import Asked, answer_all
    from mmkv_cli.cli.display import err_console
    from mmkv_cli.cli.progress import questions_progress

    lines = []
    for number, q in enumerate(asked):
        where = q.pack or pack
        if where is None:
            raise UsageError(f"question {number + 1} names no pack: give PACK, or its 'pack'")
        lines.append(Asked(number, where, q.text, q.at, q.id))
    with questions_progress(len(lines)) as tick:
        report = answer_all(lines, load, options, explain, emit_json, cluster, tick)
    if cluster is not None:
        for name, did in sorted(report["workers"].items()):
            line = f"{name}: {did['packs']} packs in {did['seconds']:.1f} s"
            err_console.print(line, highlight=False)
    return report["failed"]
