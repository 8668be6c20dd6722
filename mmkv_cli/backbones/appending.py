"""A cache layer for asking: new tokens are written into room kept after the context.

transformers' DynamicLayer concatenates on every update, so each decoded token copies the whole
context of every layer once more (at 7B, an hour's context is GBs a layer pair, copied for every
token of an answer). This layer copies the context once, on its first update, into buffers with
room after it, and from then on writes each new token in place; when the room is used up it is
made again, twice as large.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

# tokens of room made after the context: a question and a usual answer fit without growing
ROOM_TOKENS = 256


class AppendingLayer(DynamicLayer):
    """A DynamicLayer holding `keys` and `values` [B, H_kv, n, D] as given (never written: a
    pack's context may be shared), whose updates go into room after them.

    keys and values stay what the model reads: views of the first n tokens of the buffers. Code
    that replaces them with tensors of its own (a pruned context) is followed: the next update
    makes new buffers from what it finds."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int = ROOM_TOKENS):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.room = room
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        length, added = self.keys.shape[-2], key_states.shape[-2]
        if not self._has_room(length + added):
            self._make_room(length + added)
        key_buffer, value_buffer = self._buffers
        key_buffer[..., length : length + added, :].copy_(key_states)
        value_buffer[..., length : length + added, :].copy_(value_states)
        self.keys = key_buffer[..., : length + added, :]
        self.values = value_buffer[..., : length + added, :]
        return self.keys, self.values

    def _has_room(self, length: int) -> bool:
        """Whether keys and values are still the buffers' first tokens and `length` fits."""
        if self._buffers is None:
            return False
        key_buffer, value_buffer = self._buffers
        return (
            length <= key_buffer.shape[-2]
            and _views_start_of(self.keys, key_buffer)
            and _views_start_of(self.values, value_buffer)
        )

    def _make_room(self, length: int) -> None:
        """Buffers for `length` tokens and room after them, holding keys and values as they are
        (one copy, as a concatenation would make)."""
        held = self.keys.shape[-2]
        buffers = []
        for tensor in (self.keys, self.values):
            shape = (*tensor.shape[:-2], length + self.room, tensor.shape[-1])
            buffer = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
            buffer[..., :held, :].copy_(tensor)
            buffers.append(buffer)
        self._buffers = (buffers[0], buffers[1])
        self.keys, self.values = buffers[0][..., :held, :], buffers[1][..., :held, :]
        self.room *= 2  # a long answer grows it rarely, never a token at a time


def _views_start_of(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether `view` is `buffer`'s first tokens (along dim -2), as update left it."""
    return (
        view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[:-2] == buffer.shape[:-2]
    )
