"""What one question's answer is: the text and what it cost. Its own module so `import mmkv` can
export it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Answer:
    """One answer from a pack: the text, the context it was decoded from and the time it took.

    Attributes:
        answer: the decoded text, stop strings and the end token cut off.
        token_ids: the decoded token ids.
        context_tokens: tokens in the context the answer was decoded from (prompt, KV, question).
        ttft_s: seconds from the question to its first token (retrieval, reads, prefill).
        total_s: seconds from the question to the last token.
        decode_s_per_token: seconds per decoded token after the first (None: no decode step).
        blocks_used: the pack's blocks in the context, in context order.
        retrieved: per retrieved block, why it was chosen; without retrieval, with `explain`, every
            block of the context with its span (scores None), else empty.
        bytes_read: bytes of the pack this question read.
        bytes_fetched: bytes brought over the network for it (a remote pack).
        kv_tokens: per layer, the visual tokens left after pruning at ask (None: not pruned).
        phases_s: where ttft_s went: select, read, prefill, first_token.
        first_logits: the first answer token's logits, when asked for (tests, comparisons).
    """

    answer: str
    token_ids: list[int]
    context_tokens: int
    ttft_s: float
    total_s: float
    decode_s_per_token: float | None
    blocks_used: list[str]
    retrieved: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int = 0
    bytes_fetched: int = 0
    kv_tokens: list[int] | None = None
    phases_s: dict[str, float] = field(default_factory=dict)
    first_logits: torch.Tensor | None = field(default=None, repr=False)


def answer_record(
    answer: Answer, question: str, at: float | None = None, ident=None, explain: bool = True
) -> dict:
    """An answer as `ask --json` prints it (one JSON object per question); the retrieved blocks
    only when explained (an hour's retrieval lists dozens of blocks a question)."""
    record = {"id": ident} if ident is not None else {}
    return {
        **record,
        "question": question,
        "at": at,
        "answer": answer.answer,
        "context_tokens": answer.context_tokens,
        "ttft_s": answer.ttft_s,
        "ttft_phases_s": answer.phases_s,
        "total_s": answer.total_s,
        "decode_s_per_token": answer.decode_s_per_token,
        "blocks": len(answer.blocks_used),
        "bytes_read": answer.bytes_read,
        "bytes_fetched": answer.bytes_fetched,
        **({"retrieved": answer.retrieved} if explain else {}),
        "kv_tokens_after_prune": answer.kv_tokens,
    }
