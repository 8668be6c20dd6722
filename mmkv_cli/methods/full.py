"""full: every visual token of every layer. The reference all other methods are measured against."""

from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy


class FullMemory(MemoryPolicy):
    name = "full"


MEMORY, CONTEXT = FullMemory, ContextPolicy
