"""ReKV (baseline of MuKV): the whole stream kept, one block per frame (temporal step) with its mean key as
representative; at ask the top-k blocks by the question, in time order. Retrieval is shared with MuKV."""

from __future__ import annotations

from mmkv_cli.methods.base import MemoryPolicy
from mmkv_cli.methods.retrieval import RetrievalContext


class ReKVMemory(MemoryPolicy):
    name = "rekv"
    keeps_all = True


MEMORY, CONTEXT = ReKVMemory, RetrievalContext
