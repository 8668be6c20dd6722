"""A pack's tokens and the question's as the language model takes them in (methods/base.py
TakenIn), each made on first use: the question's where the model is."""

from __future__ import annotations

import torch

from mmkv_cli.backbones.base import Backbone
from mmkv_cli.pack import PackReader


class PackTakenIn:
    """What a late-interaction policy reads of a pack (`reader`) and a question (`asked`: its
    tokens in the pack's question template)."""

    def __init__(self, backbone: Backbone, reader: PackReader, asked: list[int]):
        self.backbone, self.reader, self.asked = backbone, reader, asked
        self.frames_per_step = reader.header.layout.frames_per_step or 1  # checked on open

    def blocks(self) -> torch.Tensor | None:
        return self.reader.embeddings()  # checked and held by the reader: read once a pack

    def question(self) -> torch.Tensor:
        """The prompt's text tokens as the authors' code takes them: every token but the visual
        ones (the pack's prefix and suffix, then the question)."""
        prompt, b = self.reader.header.prompt, self.backbone
        ids = b.text_ids(prompt.prefix or "") + b.text_ids(prompt.suffix_text or "") + self.asked
        embedded = b.embed_ids(ids)[0].float()
        return torch.nn.functional.normalize(embedded, p=2, dim=-1, eps=1e-8)
