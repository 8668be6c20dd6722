"""The body of `POST /v1/chat/completions`: OpenAI's fields plus mmkv's (at, prune, budget,
explain), validated before any model work, and turned into a question, its turns and AskOptions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mmkv_cli.errors import UsageError
from mmkv_cli.methods import pruning_methods
from mmkv_cli.options import SEED_RANGE, AskOptions, GenerationOptions

# the methods a request may prune its context with, from the registry (the schema lists them)
PruneName = Literal[tuple(pruning_methods())]  # type: ignore[valid-type]


class Part(BaseModel):
    type: str
    text: str | None = None


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatRequest(BaseModel):
    """The OpenAI chat-completions body, plus mmkv's own fields (at, prune, budget, explain)."""

    model_config = ConfigDict(extra="ignore")  # clients send fields mmkv has no use for

    model: str = Field(max_length=200)
    messages: list[Message] = Field(min_length=1, max_length=256)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    at: float | None = Field(None, ge=0)
    prune: PruneName | None = None
    budget: float | None = Field(None, gt=0, le=1)
    explain: bool = False

    def conversation(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The last user message, and the (user, assistant) turns before it."""
        talk = [m for m in self.messages if m.role in ("user", "assistant")]
        if not talk or talk[-1].role != "user" or not talk[-1].text().strip():
            raise UsageError("the last message must be a user message with text")
        turns, question = [], None
        for message in talk[:-1]:
            if message.role == "user":
                question = message.text()
            elif question is not None:
                turns.append((question, message.text()))
                question = None
        return talk[-1].text().strip(), tuple(turns)

    def options(self) -> AskOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return AskOptions(
            at=self.at,
            prune=self.prune,
            prune_budget=self.budget,
            generation=GenerationOptions(
                self.max_completion_tokens or self.max_tokens or 256,
                self.temperature or 0.0,
                self.top_p or 1.0,
                self.seed,
                stop,
            ),
        )
