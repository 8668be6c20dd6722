"""One matrix entry's smoke check, run by that entry's interpreter from a folder outside the
checkout: the CLI (encode, ask, inspect, verify, and the commands that never import torch), the
Python facade and `import torch` after mmkv each in a fresh process with nothing imported first,
and `serve` answering one request from the openai client.

    python .ci/smoke.py CLIP OUT.json
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CLIP = Path(sys.argv[1]).resolve()
REPORT = Path(sys.argv[2]).resolve()
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "MMKV_API_KEY": ""}
QUESTION = "what color is the circle ?"
steps: dict[str, float] = {}


def step(name: str, argv: list[str], expect: str | None = None) -> str:
    """Run one command in a fresh process; its stdout, or the run fails with what it said."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=300)
    steps[name] = round(time.perf_counter() - started, 2)
    if done.returncode != 0:
        sys.exit(f"smoke: {name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    out = done.stdout.strip()
    if expect is not None and out.splitlines()[-1:] != [expect]:
        sys.exit(f"smoke: {name} printed {out[-500:]!r}, not {expect!r}")
    return out


def python(name: str, code: str, expect: str | None = None) -> str:
    return step(name, [sys.executable, "-c", code], expect)


mmkv = str(BIN / "mmkv")
no_torch = (
    "import sys\nfrom mmkv_cli.cli.app import main\nsys.argv = ['mmkv', *sys.argv[1:]]\n"
    "try:\n    main()\nexcept SystemExit as done:\n    code = done.code\n"
    "print('torch' in sys.modules, 'transformers' in sys.modules, code)\n"
)
step("encode", [mmkv, "encode", str(CLIP), "--model", "demo", "-o", "clip.kvpack", "--force"])
step("ask", [mmkv, "ask", "clip.kvpack", QUESTION], expect="red")
step("encode hermes", [mmkv, "encode", str(CLIP), "--model", "demo", "--method", "hermes"]
     + ["-o", "hermes.kvpack", "--force"])  # fmt: skip
verify = ["verify", "hermes.kvpack"]
for args in (["--help"], ["methods", "--json"], ["models"], ["inspect", "hermes.kvpack", "--json"],
             verify):  # fmt: skip
    step(f"{args[0]} without torch", [sys.executable, "-c", no_torch, *args], "False False 0")
python(
    "facade",
    "import mmkv\n"
    f"mmkv.encode({str(CLIP)!r}, 'facade.kvpack', model='demo', force=True)\n"
    f"print(mmkv.ask('facade.kvpack', {QUESTION!r}).answer)",
    "red",
)
python(
    "torch after mmkv_cli.core.lazy",
    "import mmkv_cli.core.lazy; import torch; print(torch.zeros(1)[0].item())",
    "0.0",
)

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
Path("served").mkdir(exist_ok=True)
os.replace("clip.kvpack", "served/clip.kvpack")
started = time.perf_counter()
server = subprocess.Popen(
    [mmkv, "serve", "--packs", "served", "--port", str(port), "--device", "cpu"],
    env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
)  # fmt: skip
try:
    import httpx
    import openai

    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if server.poll() is not None:
                sys.exit(f"smoke: serve exited {server.returncode}: {server.stderr.read()[-2000:]}")
            time.sleep(0.3)
    else:
        sys.exit("smoke: serve did not answer /health in 120 s")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model="clip", messages=[{"role": "user", "content": QUESTION}], max_tokens=8
    )
    if reply.choices[0].message.content != "red":
        sys.exit(f"smoke: serve answered {reply.choices[0].message.content!r}, not 'red'")
    steps["serve"] = round(time.perf_counter() - started, 2)
finally:
    server.terminate()
    server.wait(30)

from importlib import metadata  # noqa: E402

REPORT.write_text(
    json.dumps(
        {
            "python": sys.version.split()[0],
            **{name: metadata.version(name) for name in ("torch", "torchvision", "transformers")},
            "seconds": steps,
            "ok": True,
        },
        indent=1,
    )
    + "\n"
)
print(f"smoke: ok on Python {sys.version.split()[0]}, torch {metadata.version('torch')}: {steps}")
