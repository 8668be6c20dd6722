"""The body of `POST /v1/chat/completions`: OpenAI's fields plus mmkv's (at, prune, budget,
explain), validated before any model work, and turned into a question, its turns and AskOptions."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mmkv_cli.core.errors import UsageError
from mmkv_cli.core.options import SEED_RANGE, AskOptions, GenerationOptions
from mmkv_cli.methods import pruning_methods

# the methods a request may prune its context with, from the registry (the schema lists them)
PruneName = Literal[tuple(pruning_methods())]  # type: ignore[valid-type]


class Part(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls...: refused below where they matter

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    include_usage: bool = False


# OpenAI fields mmkv cannot honour, with the value that asks nothing of it: a request that sets one
# otherwise is refused naming it, never answered as if it had not asked
UNSUPPORTED = {
    "n": 1,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "logprobs": False,
    "top_logprobs": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "audio": None,
    "prediction": None,
}


class ChatRequest(BaseModel):
    """The OpenAI chat-completions body, plus mmkv's own fields (at, prune, budget, explain)."""

    model_config = ConfigDict(extra="ignore")  # user, metadata, store...: nothing to do with them

    model: str = Field(max_length=200)
    messages: list[Message] = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    at: float | None = Field(None, ge=0)
    prune: PruneName | None = None
    budget: float | None = Field(None, gt=0, le=1)
    explain: bool = False
    n: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    logit_bias: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    audio: dict | None = None
    prediction: dict | None = None

    @model_validator(mode="after")
    def _asks_only_what_mmkv_does(self) -> ChatRequest:
        asked = self.model_dump(include=set(UNSUPPORTED))
        for name, neutral in UNSUPPORTED.items():
            value = asked[name]
            if value is not None and value != neutral and value != [] and value != {}:
                raise ValueError(f"{name} is not supported by mmkv (it answers one text choice)")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format {kind!r} is not supported (text only)")
        if self.modalities and set(self.modalities) != {"text"}:
            raise ValueError("modalities other than text are not supported")
        for i, message in enumerate(self.messages):
            if message.role == "tool":
                raise ValueError(f"messages.{i}: tool messages are not supported")
            for part in message.content if isinstance(message.content, list) else ():
                if part.type != "text":
                    raise ValueError(
                        f"messages.{i}.content: {part.type} parts are not supported: a pack "
                        "answers about the media it was encoded from"
                    )
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def conversation(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The last user message, and the (user, assistant) turns before it. System and developer
        messages are instructions: their text goes before the question (the pack's own prompt,
        fixed at encode, stays as it is)."""
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
        rules = [m.text().strip() for m in self.messages if m.role in ("system", "developer")]
        asked = talk[-1].text().strip()
        return "\n\n".join([*(r for r in rules if r), asked]), tuple(turns)

    def options(self) -> AskOptions:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return AskOptions(
            at=self.at,
            prune=self.prune,
            prune_budget=self.budget,
            explain=self.explain,
            generation=GenerationOptions(
                self.max_completion_tokens or self.max_tokens or 256,
                self.temperature or 0.0,
                self.top_p or 1.0,
                self.seed,
                stop,
            ),
        )
