"""The verbs as Python functions, the face every surface calls (the CLI, the server, the
`mmkv` package): encode and convert (encoding), ask (asking), inspect, listing and verify (the
pack's report), the backbones this process holds (process), and a stream followed live (live,
imported on its own: it builds on these).

Only light modules are imported here: `inspect` of a local pack must not pay for torch. encode and
ask import the model side when they run.
"""

from __future__ import annotations

from mmkv_cli.api.asking import (
    PackSession,
    ask,
    context_policy,
    load_for,
    pack_model,
    stored_method,
)
from mmkv_cli.api.encoding import (
    EncodeProgress,
    check_encode,
    convert,
    encode,
    refuse_input_as_output,
    thinned,
)
from mmkv_cli.api.process import PROCESS_BACKBONES, unload
from mmkv_cli.ask.result import answer_record  # as `ask --json` prints an answer
from mmkv_cli.pack import convert_quant, inspect, listing, verify

__all__ = [
    "PROCESS_BACKBONES",
    "EncodeProgress",
    "PackSession",
    "answer_record",
    "ask",
    "check_encode",
    "context_policy",
    "convert",
    "convert_quant",
    "encode",
    "inspect",
    "listing",
    "load_for",
    "pack_model",
    "refuse_input_as_output",
    "stored_method",
    "thinned",
    "unload",
    "verify",
]
