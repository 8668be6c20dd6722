"""The backbone seam: the only code that knows a model's internals. Methods see tensors, never
models."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from mmkv_cli.backbones.appending import AppendingLayer
from mmkv_cli.backbones.spec import ModelSpec
from mmkv_cli.core.errors import ModelError
from mmkv_cli.kernels import attention


@dataclass
class StreamLayout:
    """Positions of the whole encode stream [prefix | visual | suffix], and where the question
    starts.

    positions are [P, n] with P = 1 (1-D RoPE) or 3 (M-RoPE temporal/height/width).
    """

    prefix: torch.Tensor
    visual: torch.Tensor
    suffix: torch.Tensor
    next_position: int  # the first text position after the suffix (the question's first token)
    rope_delta: int  # next_position - physical length of the stream: 0 for 1-D RoPE
    step_lengths: list[
        int
    ]  # tokens each temporal step adds to the stream (its visual tokens + any markers)
    grid: tuple[int, int]  # visual tokens of one temporal step as (rows, cols)
    resize_to: tuple[int, int] | None = (
        None  # one pixel size for every chunk of the clip, when the family needs it
    )
    grid_offsets: list[int] | None = (
        None  # per step, marker tokens before its grid (None: the grid starts the step)
    )

    def offsets(self) -> list[int]:
        return self.grid_offsets or [0] * len(self.step_lengths)


@dataclass(frozen=True)
class PromptPieces:
    prefix: str  # system + user turn, up to where the visual tokens go
    suffix_text: str  # text right after the visual tokens (may be empty)
    question: str  # template with {question}: the rest of the user turn and the answer prefix
    # after an answer, what closes the assistant turn and opens the next user turn (chat follow-ups)
    next_turn: str = "<|im_end|>\n<|im_start|>user\n"

    def as_dict(self) -> dict:
        return {"prefix": self.prefix, "suffix_text": self.suffix_text, "question": self.question}


def fill(template: str, question: str) -> str:
    """The question in its template. Plain replacement, not str.format: a template may come from a
    stranger's pack, and braces in it or in the question must stay text."""
    return template.replace("{question}", question, 1)


def text_kv(cfg) -> dict:
    """{layers, kv_heads, head_dim} of a language model's transformers config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
    }


class Backbone:
    """Adapter over a transformers vision-language model. Subclasses fill in the family
    specifics."""

    family: str = ""
    position_dims: int = 1

    def __init__(
        self, model, tokenizer, video_processor, name: str, spec: ModelSpec, prompt: PromptPieces
    ):
        self.model = model.eval()
        text = model.config.get_text_config()
        kv = text_kv(text)
        attention.install(model, text.num_attention_heads, kv["kv_heads"], kv["head_dim"])
        self.tokenizer = tokenizer
        self.video_processor = video_processor
        self.name = name  # as the user named it: a preset, an HF id or a folder
        self.spec = spec  # the model preset, resolved once (an HF id gets the defaults)
        self.source = spec.source
        self.prompt = prompt
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.text_config = text
        self._lm = model.model.language_model

    # --- geometry, filled in by the family ---
    frames_per_step: int = 1  # frames fused into one temporal step (Qwen: temporal_patch_size)
    # each step's positions follow from where the one before ended (backbones/layouts.py): a live
    # stream's layout grows by its new steps alone
    positions_scan: bool = False

    def tokens_per_step(self, frame_hw: tuple[int, int]) -> int:
        raise NotImplementedError

    def prepare(self, frames: np.ndarray, layout: StreamLayout) -> dict | None:
        """The vision tower's inputs for these frames, made by the model's processor on the host
        (host tensors by name), on any thread: on a GPU the encode makes the next chunk's while
        this one runs. Given back as `inputs` below; None: the family makes them as it embeds."""
        return None

    def visual_embeds(self, frames: np.ndarray, inputs: dict | None = None) -> torch.Tensor:
        """uint8 [T, H, W, 3] (T a multiple of frames_per_step) -> [1, steps * tokens_per_step,
        hidden]. inputs: `prepare`'s for these frames (None: made here)."""
        raise NotImplementedError

    def visual_chunk(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """The stream tokens of these frames' steps, and any extra inputs the language model needs
        for them."""
        return self.visual_embeds(frames, inputs), {}

    def visual_chunk_scored(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor]:
        """visual_chunk, and the attention each grid token got in the vision tower [steps, grid
        tokens], on the model's device (token reducers that read it). Only families whose registry
        row says tower_attention give it; the encoder refuses the rest before any work."""
        raise ModelError(f"the {self.family} adapter does not expose its vision tower's attention")

    def visual_chunk_reusing(
        self,
        frames: np.ndarray,
        step_times: list[tuple[float, float]],
        layout: StreamLayout,
        inputs: dict | None,
        reuse: tuple[dict, int, float],
    ) -> tuple[torch.Tensor, dict, dict]:
        """visual_chunk with the vision tower reusing its layers from frame to frame (STC's
        cacher): reuse is (the state the chunk before left, every Nth frame runs whole, the share
        of tokens the others recompute); gives the state for the next chunk too. Only families
        whose registry row says tower_reuse; the encoder refuses the rest before any work."""
        raise ModelError(f"the {self.family} adapter does not reuse its vision tower's layers")

    def suffix_embeds(self) -> torch.Tensor:
        """What follows the last visual token, as embeddings [1, s, hidden]."""
        return self.embed_ids(self.text_ids(self.prompt.suffix_text))

    def stream_layout(
        self,
        frame_hw: tuple[int, int],
        step_times: list[tuple[float, float]],
        clip_frames: int | None = None,
    ) -> StreamLayout:
        """Positions of [prefix | one entry per temporal step | suffix] for frames of this size.
        clip_frames: the clip length frames are sized for, where a family sizes them by it (Qwen3-VL
        shares a pixel budget over the clip); None: the clip's own. A live stream, whose length
        nobody knows, pins it."""
        raise NotImplementedError

    # --- text ---
    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def question_ids(self, question: str, template: str | None = None) -> list[int]:
        return self.text_ids(fill(template or self.prompt.question, question))

    def turns_ids(
        self, turns: tuple[tuple[str, str], ...], template: str | None = None
    ) -> list[int]:
        """Earlier (question, answer) turns as the text a follow-up question comes after."""
        form = template or self.prompt.question
        text = "".join(fill(form, q) + a + self.prompt.next_turn for q, a in turns)
        return self.text_ids(text) if text else []

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        table = self.model.get_input_embeddings()
        ids = torch.tensor([ids], dtype=torch.long)  # made on the host, sent without a wait
        return table(ids.to(self.device, non_blocking=True))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_ids(self) -> set[int]:
        stops = set()
        for source in (
            self.text_config,
            getattr(self.model, "generation_config", None),
            self.tokenizer,
        ):
            value = getattr(source, "eos_token_id", None)
            if value is not None:
                stops.update(value if isinstance(value, (list, tuple)) else [value])
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            stops.add(im_end)
        return {s for s in stops if isinstance(s, int) and 0 <= s < self.text_config.vocab_size}

    # --- language model ---
    def text_positions(self, start: int, count: int) -> torch.Tensor:
        """[P, count] positions for text tokens: the same on every M-RoPE axis."""
        pos = torch.arange(start, start + count, device=self.device)
        return pos.unsqueeze(0).expand(self.position_dims, -1)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.text_config)

    def cache_from_layers(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        batch: int = 1,
        adopt: bool = False,
    ) -> DynamicCache:
        """A cache holding per-layer [H_kv, n, D] tensors, the same for each of `batch` rows.
        adopt: the tensors were made for this cache (a pack's context, GBs at an hour): it holds
        them as they are, where a plain update would copy every layer once more, and its updates
        (a question, each token of the answer) go into room after them (AppendingLayer), where
        a plain update copies the whole context each time."""
        cache = self.new_cache()
        for layer, (k, v) in enumerate(zip(keys, values)):
            k, v = (
                t.to(self.device, self.dtype, non_blocking=True)
                .unsqueeze(0)
                .expand(batch, -1, -1, -1)
                for t in (k, v)
            )
            if not adopt or batch != 1:
                cache.update(k, v, layer)
                continue
            cache.update(k[:, :, :0], v[:, :, :0], layer)  # sets the layer up, holding nothing
            entry = cache.layers[layer]
            if type(entry) is DynamicLayer:  # a question and its answer go into room after it
                cache.layers[layer] = AppendingLayer(k, v)
            else:  # never written in place: updates concatenate
                entry.keys, entry.values = k, v
        return cache

    def select_extra(self, extra: dict, index: torch.Tensor) -> dict:
        """The extra LM inputs of a chunk, for a batch of token subsets index [B, N] of that
        chunk."""
        return {}

    def _lm_positions(self, positions: torch.Tensor) -> torch.Tensor:
        # positions [P, n] or [P, B, n]; Qwen's text model takes (3, B, n), a 1-D model (B, n).
        if positions.dim() == 2:
            positions = positions.unsqueeze(1)
        return positions if self.position_dims == 3 else positions[0]

    @torch.inference_mode()
    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: DynamicCache, **extra
    ) -> torch.Tensor:
        """Run the language model over embeds [B, n, hidden] at explicit positions [P, n] or [P, B,
        n]."""
        out = self._lm(
            inputs_embeds=embeds.to(self.dtype),
            position_ids=self._lm_positions(positions.to(self.device, non_blocking=True)),
            cache=cache,  # 5.24 renamed past_key_values (removed in 5.40)
            use_cache=True,
            **extra,
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    # --- identity ---
    def fingerprint(self) -> dict:
        config = json.dumps(self.model.config.to_dict(), sort_keys=True, default=str)
        return {
            "model": self.name,
            "source": self.source,
            "family": self.family,
            "revision": getattr(self.model.config, "_commit_hash", None),
            "config_sha256": hashlib.sha256(config.encode()).hexdigest()[:16],
            "weights_sha256": self._weights_probe_digest,  # once: reading weights waits for them
            "transformers": transformers.__version__,
        }

    @functools.cached_property
    def _weights_probe_digest(self) -> str:
        """A cheap digest of a few weights: tells two checkpoints of one architecture apart."""
        h = hashlib.sha256()
        probes = [
            self.model.get_input_embeddings().weight,
            self.model.lm_head.weight,
            self._lm.layers[0].self_attn.q_proj.weight,
        ]
        for weight in probes:
            h.update(weight.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def kv_shape(self) -> dict:
        return {**text_kv(self.text_config), "dtype": str(self.dtype).replace("torch.", "")}

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inv_freq [D/2], position axis of each frequency [D/2]) for delta-rotating stored
        keys, on the host; read off the model once (reading a buffer waits for the device)."""
        return self._rope_tables

    @functools.cached_property
    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self._lm.rotary_emb
        inv_freq = rotary.inv_freq.detach().float().cpu()
        if self.position_dims == 1:
            return inv_freq, torch.zeros_like(inv_freq, dtype=torch.long)
        # Ask the model's own M-RoPE layout which axis each frequency reads: feed each axis its
        # index.
        probe = torch.arange(3, dtype=torch.float32)[:, None].repeat(1, inv_freq.numel())
        axes = rotary.recomposition_frequencies(probe)[..., : inv_freq.numel()].reshape(-1).long()
        return inv_freq, axes

    def rotary(self) -> dict:
        """The rotary settings a context policy needs to re-rotate stored keys."""
        params = dict(getattr(self.text_config, "rope_parameters", None) or {})
        return {
            "scheme": "mrope" if self.position_dims == 3 else "rope",
            "keys": "post-rope",
            **params,
        }
