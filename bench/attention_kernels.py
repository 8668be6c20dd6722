"""The language model's attention kernels at LLaVA-OV-7B's widths (28 query heads over 4 KV heads
of 128, bfloat16): `grouped_sdpa` where the mask is declared causal, against transformers' SDPA
given the causal mask written out (its repeat_kv copies, then a kernel that reads the mask), for an
encode's chunk over its cache and a question over the context. Part of bench/gpu.py's parity:

    python bench/attention_kernels.py [--device cuda] [--keys 25088]

On CUDA the declared path is flash attention aligned to the last key (kernels/attention.py); on the
CPU it is SDPA with the mask and the grouped heads. Both must give the written-out mask's answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, DIM = 28, 4, 128
# a bfloat16 output's rounding (8 bits of mantissa) on values of about 1: two kernels that sum in
# different orders differ by a few of its steps
TOLERANCE = 0.03


def compare(device: str, rows: int, keys: int, dtype_name: str, tries: int = 3) -> dict:
    """One shape: the largest difference between the two paths' outputs, whether flash ran, and
    each path's seconds (best of `tries`, the device waited for)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from mmkv_cli.kernels import attention

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(1, HEADS, rows, DIM, generator=g, device=device).to(dtype)
    key = torch.randn(1, KV_HEADS, keys, DIM, generator=g, device=device).to(dtype)
    value = torch.randn(1, KV_HEADS, keys, DIM, generator=g, device=device).to(dtype)
    mask = attention.own_length_mask(query, key, None)
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)
    attention._sdpa = sdpa_attention_forward  # noqa: SLF001 (install() binds it with a model)

    def declared():
        return attention.grouped_sdpa(module, query, key, value, mask, causal=True)[0]

    def written_out():
        return sdpa_attention_forward(module, query, key, value, mask)[0]

    def best(work) -> float:
        seconds = []
        for _ in range(tries):
            if device == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            work()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - began)
        return round(min(seconds), 5)

    with torch.inference_mode():
        difference = (declared().float() - written_out().float()).abs().max().item()
        flash = attention._flash_lower_right(query, key, value)  # noqa: SLF001
        return {"rows": rows, "keys": keys, "dtype": dtype_name, "flash": flash,
                "max_difference": difference, "equal": difference <= TOLERANCE,
                "declared_s": best(declared), "written_out_s": best(written_out)}  # fmt: skip


def check(device: str, keys: int) -> dict:
    """A chunk of 16 frames (3,136 rows) over `keys`, and a question's 40 rows over them."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    shapes = [compare(device, rows, keys, dtype) for rows in (3136, 40)]
    return {"device": device, "shapes": shapes, "all_equal": all(s["equal"] for s in shapes)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--keys", type=int, default=25088)
    args = ap.parse_args()
    print(json.dumps(check(args.device, args.keys), indent=1))


if __name__ == "__main__":
    main()
