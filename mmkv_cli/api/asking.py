"""ask as Python: a pack opened with its method's context policy and a backbone that fits it
(the pack's own model where it may be trusted to name one), for one question or many."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mmkv_cli.api.process import PROCESS_BACKBONES
from mmkv_cli.core import logs
from mmkv_cli.core.errors import PackError, UsageError
from mmkv_cli.core.options import MAX_QUESTION_CHARS, AskOptions, LoadOptions, check_ask
from mmkv_cli.core.spec import override
from mmkv_cli.methods import METHODS
from mmkv_cli.methods.base import ContextPolicy
from mmkv_cli.methods.context import WholeContext
from mmkv_cli.pack import PackReader

if TYPE_CHECKING:
    from mmkv_cli.ask.result import Answer
    from mmkv_cli.backbones.base import Backbone
    from mmkv_cli.pack import MemoryPack

LOG = logs.get("mmkv_cli.api")  # one name for the verbs, as users filter by it


def context_policy(reader: PackReader) -> ContextPolicy:
    """The context policy of the method a pack names, with the parameters it was encoded with."""
    chosen, params = stored_method(reader)
    return chosen.context(params) if chosen.context is not None else WholeContext()


def stored_method(reader: PackReader):
    """(the method a pack names, its typed parameters as the pack stores them)."""
    record = reader.header.method
    if record.in_code not in METHODS:
        raise PackError(f"{reader.path} names an unknown method '{record.in_code}'")
    chosen = METHODS[record.in_code]
    try:
        if record.params_exact:
            return chosen, override(chosen.params(), record.params, "method.params")
        # older packs kept other keys beside the parameters: apply those that still fit
        params = chosen.params()
        for key, value in record.params.items():
            try:
                params = override(params, {key: value}, "method.params")
            except UsageError:
                continue
        return chosen, params
    except UsageError as err:
        raise PackError(f"{reader.path}: {err}") from None


def pack_model(reader: PackReader) -> str:
    """The model a pack names, when it may be loaded on the pack's word: a preset known here, or a
    hub id already on this machine. Never a path (a stranger's pack must not point `ask` at any
    checkpoint or file here), nor a download: --model chooses either explicitly."""
    from mmkv_cli.backbones.spec import HUB_ID, in_hub_cache, model_names

    named = reader.header.fingerprint.model
    if isinstance(named, str) and named in model_names():
        return named
    if isinstance(named, str) and HUB_ID.fullmatch(named) and not Path(named).exists():
        if in_hub_cache(named):
            return named
        raise PackError(
            f"{reader.path} names the hub model '{named}', which is not on this machine: pass "
            f"--model {named} to download and use it (or --model with another checkpoint)"
        )
    raise PackError(
        f"{reader.path} names the model {str(named)[:80]!r}, which is neither a preset here nor a "
        "hub id: pass --model to choose the checkpoint"
    )


def load_for(reader: PackReader, load: LoadOptions) -> LoadOptions:
    """How to load the backbone that answers from `reader`: `load`'s model, else the pack's own. A
    rehearsal model is built at the depth the pack records (a CPU bench cuts it); a checkpoint's
    depth is its own, and ignores it. Refused before anything is built when the model's config
    makes KV of another shape than the pack holds."""
    from mmkv_cli.backbones.loading import planned_kv

    layers = load.layers or reader.header.kv.layers
    chosen = replace(load, model=load.model or pack_model(reader), layers=layers)
    planned, kv = planned_kv(chosen), reader.header.kv
    if planned is not None and (planned["kv_heads"], planned["head_dim"], planned["layers"]) != (
        kv.kv_heads,
        kv.head_dim,
        kv.layers,
    ):
        raise PackError(
            f"{reader.path} holds KV of {kv.layers} layers x {kv.kv_heads} heads x {kv.head_dim}, "
            f"and model '{chosen.model}' makes {planned['layers']} layers x {planned['kv_heads']} "
            f"heads x {planned['head_dim']}: ask with the model that encoded it (--model)"
        )
    return chosen


class PackSession:
    """One pack opened, its context policy built and its backbone loaded, for many questions: the
    process pays for torch and the model once, not per question."""

    def __init__(
        self,
        pack: str | Path | PackReader | MemoryPack,
        *,
        backbone: Backbone | None = None,
        load: LoadOptions | None = None,
        shared: bool = False,
    ):
        """shared: take the backbone from the process's held ones (`PROCESS_BACKBONES`), loading it
        there once for every later session (Python's `mmkv.ask` in a loop)."""
        from mmkv_cli.pack import check_askable

        # the pack first: a missing or broken one is refused before torch is imported
        self.reader = PackReader(pack) if isinstance(pack, str | Path) else pack
        check_askable(self.reader.header, str(self.reader.path))
        self.policy = context_policy(self.reader)
        if backbone is None:
            from mmkv_cli.backbones.loading import load_backbone

            chosen = load_for(self.reader, load or LoadOptions())
            backbone = PROCESS_BACKBONES.get(chosen) if shared else load_backbone(chosen)
        self.backbone = backbone
        self._fetched = 0  # the remote pack's bytes already charged to a question (none yet)

    @property
    def media_kind(self) -> str:
        """What the pack was made from: video, images or document (how its blocks are shown)."""
        return self.reader.header.media.kind

    def turn_tokens(self, turns: tuple[tuple[str, str], ...]) -> int:
        """How many tokens earlier (question, answer) turns take in this model's prompt."""
        return len(self.backbone.turns_ids(turns))

    def close(self) -> None:
        """Let go of the pack's file (a memory pack holds none)."""
        if isinstance(self.reader, PackReader):
            self.reader.source.close()

    def ask(
        self,
        question: str,
        options: AskOptions | None = None,
        on_token: Callable[[str], None] | None = None,
    ) -> Answer:
        """Answer `question` from the pack alone; the media is never read again.

        options.at: the question's moment (seconds, or the index of an image or page): only blocks
        whose every frame was shown by then count (a block spanning it is left out whole).
        options.prune: a method that prunes the context's visual KV by the question's attention
        before decoding, keeping options.prune_budget of it.
        """
        from mmkv_cli.ask.answer import answer_from_pack
        from mmkv_cli.ask.prune import ask_pruner

        options = options or AskOptions()
        check_ask(options)
        try:
            question.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("the question is not valid UTF-8 text") from None
        if len(question) > MAX_QUESTION_CHARS:  # chat and serve too, not only ask's files
            raise UsageError(f"the question is longer than {MAX_QUESTION_CHARS} characters")
        pruner = ask_pruner(options.prune, options.prune_budget) if options.prune else None
        before = self.reader.bytes_read
        answer = answer_from_pack(
            self.backbone, self.reader, self.policy, question, options, pruner, on_token
        )
        answer.bytes_read = self.reader.bytes_read - before  # this question's reads only
        if LOG.isEnabledFor(logging.DEBUG):  # the phases are joined only when shown
            LOG.debug(
                "answered from %d blocks, %d context tokens: ttft %.3f s (%s), %d bytes read",
                len(answer.blocks_used), answer.context_tokens, answer.ttft_s,
                ", ".join(f"{k} {v:.3f}" for k, v in answer.phases_s.items()), answer.bytes_read,
            )  # fmt: skip
        fetched = self.reader.fetched or 0
        answer.bytes_fetched, self._fetched = fetched - self._fetched, fetched
        return answer


def ask(
    pack: str | Path,
    question: str,
    options: AskOptions | None = None,
    *,
    backbone: Backbone | None = None,
    load: LoadOptions | None = None,
    on_token: Callable[[str], None] | None = None,
) -> Answer:
    """One question: a PackSession used once."""
    return PackSession(pack, backbone=backbone, load=load).ask(question, options, on_token)
