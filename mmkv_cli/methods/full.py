"""full: every visual token of every layer. The reference all other methods are measured against."""

from mmkv_cli.methods.base import ContextPolicy, MemoryPolicy


class FullMemory(MemoryPolicy):
    name = "full"
    keeps_all = True


MEMORY, CONTEXT = FullMemory, ContextPolicy
