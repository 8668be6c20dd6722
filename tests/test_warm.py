"""Issue 71: one warm server behind the CLI. The same command prints the same through a server as in
its own process; hot packs are never stale; the channel is private; faults are one line."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmkv_cli.api import PackSession
from mmkv_cli.cli.app import app
from mmkv_cli.core.options import AskOptions, GenerationOptions, LoadOptions
from mmkv_cli.serve import wire
from mmkv_cli.serve.client import RemoteSession, connect
from mmkv_cli.serve.local import AlreadyServing, LocalServer
from mmkv_cli.serve.place import Place
from mmkv_cli.serve.warm import Warm
from tests.conftest import ROOT, SAMPLES
from tests.helpers import encode_pack

runner = CliRunner()
CIRCLE = "what color is the circle ?"
FIRST = "which shape appeared first ?"
# what differs between two runs of the same command: clocks and what a hot pack spared reading
VARYING = re.compile(r"(_s|_s_per_token|^created|^bytes_read|^bytes_fetched)$")


def _short_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="mw-", dir="/tmp"))
    folder.chmod(0o700)
    return folder


@pytest.fixture(scope="module")
def packs(tmp_path_factory, backbones):
    folder = tmp_path_factory.mktemp("warm")
    made = {}
    for method in ("full", "mukv", "rekv"):
        made[method] = folder / f"{method}.kvpack"
        encode_pack(str(SAMPLES / "clip.mp4"), made[method], "demo", method)
    return made


@pytest.fixture(scope="module")
def server():
    """A warm server on a thread of this process, at its own socket (MMKV_HOST names it)."""
    folder = _short_folder()
    place = Place(folder / "mmkv.sock")
    warm = Warm(LoadOptions(device="cpu"), models=2)
    local = LocalServer(warm, place)
    local.bind()
    thread = threading.Thread(target=local.serve, daemon=True)
    thread.start()
    yield local
    local.stop()
    thread.join(10)
    warm.close()
    shutil.rmtree(folder, ignore_errors=True)


def _masked(text: str) -> str:
    """A command's output with its clocks blanked (JSON values, and 'in 0.04 s')."""
    lines = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            lines.append(re.sub(r"in \d+(\.\d+)? s", "in T s", line))
            continue
        if isinstance(record, dict):
            record = {k: ("T" if VARYING.search(k) else v) for k, v in record.items()}
        lines.append(json.dumps(record, sort_keys=True))
    return "\n".join(lines)


def _both_ways(server, monkeypatch, args: list[str], stdin: str | None = None):
    """The command run in its own process's way (--no-server) and through the server."""
    here = runner.invoke(app, [*args, "--no-server"], input=stdin)
    monkeypatch.setenv("MMKV_HOST", str(server.place.socket))
    served = runner.invoke(app, args, input=stdin)
    monkeypatch.delenv("MMKV_HOST")
    return here, served


@pytest.mark.parametrize(
    "case",
    [
        ["{full}", CIRCLE],
        ["{full}", CIRCLE, FIRST, "--json"],
        ["{rekv}", FIRST, "--explain"],
        ["{rekv}", FIRST, "--json", "--explain", "--at", "2"],
        [
            "{mukv}",
            "which shape appeared last ?",
            "--max-new-tokens",
            "3",
            "--positions",
            "reindex",
        ],
        ["{mukv}", CIRCLE, "--prune", "snapkv", "--budget", "0.5", "--json"],
        ["{full}", CIRCLE, "--temperature", "0.8", "--seed", "3", "--json"],
        ["{full}", "x" * 70000],  # a question over the limit: one line, each question's own
        ["{full}.missing", CIRCLE],  # no pack: exit 4 before any model
        ["{full}", CIRCLE, "--temperature", "-1"],  # a bad option: exit 2
        ["{full}", CIRCLE, "--model", "tiny-qwen2-vl"],  # a model of another shape: exit 4
    ],
)
def test_ask_prints_the_same_through_the_server_as_in_its_own_process(
    server, packs, monkeypatch, case
):
    args = ["ask", *(a.format(**{k: str(v) for k, v in packs.items()}) for a in case)]
    here, served = _both_ways(server, monkeypatch, args)
    assert served.exit_code == here.exit_code, (here.output, served.output)
    assert _masked(served.stdout) == _masked(here.stdout)
    assert served.stderr == here.stderr


def test_a_hot_packs_second_question_reads_nothing_from_the_file(server, packs, monkeypatch):
    monkeypatch.setenv("MMKV_HOST", str(server.place.socket))
    pack = str(packs["rekv"])
    first = json.loads(runner.invoke(app, ["ask", pack, FIRST, "--json"]).stdout)
    again = json.loads(runner.invoke(app, ["ask", pack, FIRST, "--json"]).stdout)
    cold = json.loads(runner.invoke(app, ["ask", pack, FIRST, "--json", "--no-server"]).stdout)
    assert again["bytes_read"] == 0 and cold["bytes_read"] > 0
    assert first["answer"] == again["answer"] == cold["answer"]
    state = json.loads(runner.invoke(app, ["ps", "--json"]).stdout)
    hot = {Path(p["path"]).name: p for p in state["packs"]}
    assert hot["rekv.kvpack"]["bytes"] > 0 and hot["rekv.kvpack"]["questions"] >= 2
    assert hot["rekv.kvpack"]["where"] == "host"  # a CPU server: plain host memory
    assert "hot packs" in runner.invoke(app, ["ps"]).stdout
    assert [m["model"] for m in state["models"]].count("demo") == 1


def test_chat_prints_the_same_through_the_server(server, packs, monkeypatch):
    lines = f"{CIRCLE}\nand the first shape ?\n/at 2\n{FIRST}\n/explain\n/reset\n{CIRCLE}\n"
    here, served = _both_ways(server, monkeypatch, ["chat", str(packs["rekv"])], stdin=lines)
    assert served.exit_code == here.exit_code == 0
    assert served.stdout == here.stdout and served.stderr == here.stderr


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "mukv", "--json"],
        ["--method", "hermes", "--budget-tokens", "24"],
        ["--method", "nope"],  # exit 2 before any model
        ["--method", "full", "--kv-bits", "3"],  # exit 2
    ],
)
def test_encode_writes_the_same_pack_through_the_server(server, tmp_path, monkeypatch, extra):
    clip = str(SAMPLES / "clip.mp4")
    (tmp_path / "here").mkdir(), (tmp_path / "away").mkdir()  # names of one length: one wrap
    out_here, out_served = tmp_path / "here" / "x.kvpack", tmp_path / "away" / "x.kvpack"
    common = ["--model", "demo", *extra]
    here = runner.invoke(app, ["encode", clip, "-o", str(out_here), *common, "--no-server"])
    monkeypatch.setenv("MMKV_HOST", str(server.place.socket))
    served = runner.invoke(app, ["encode", clip, "-o", str(out_served), *common])
    assert served.exit_code == here.exit_code, (here.output, served.output)
    same = _masked(served.stdout.replace("/away/", "/here/"))
    assert same == _masked(here.stdout) and served.stderr == here.stderr
    if here.exit_code == 0:
        ask = ["ask", "{}", CIRCLE, "--json", "--no-server"]
        answers = [
            runner.invoke(app, [a.format(p) for a in ask]).stdout for p in (out_here, out_served)
        ]
        assert _masked(answers[0]) == _masked(answers[1])
        again = runner.invoke(app, ["encode", clip, "-o", str(out_served), *common])
        assert again.exit_code == 6 and "already exists" in again.stderr  # never overwritten


def test_a_pack_replaced_cut_or_rewritten_is_never_answered_from_its_hot_copy(
    server, packs, tmp_path, monkeypatch
):
    monkeypatch.setenv("MMKV_HOST", str(server.place.socket))
    target = tmp_path / "moving.kvpack"
    shutil.copy(packs["full"], target)

    def asked() -> dict:
        result = runner.invoke(app, ["ask", str(target), CIRCLE, "--json"])
        return {"code": result.exit_code, **(json.loads(result.stdout) if result.stdout else {})}

    def reference(source: Path) -> dict:
        result = runner.invoke(app, ["ask", str(source), CIRCLE, "--json", "--no-server"])
        return json.loads(result.stdout)

    assert asked()["blocks"] == reference(packs["full"])["blocks"]
    # replaced by a rename (as mmkv and rsync write)
    shutil.copy(packs["mukv"], tmp_path / "next.kvpack")
    os.replace(tmp_path / "next.kvpack", target)
    assert asked()["blocks"] == reference(packs["mukv"])["blocks"]
    # overwritten in place, the same inode
    with open(target, "r+b") as file:
        file.write(packs["rekv"].read_bytes())
        file.truncate()
    assert asked()["blocks"] == reference(packs["rekv"])["blocks"]
    # cut short: the one line and exit an in-process ask gives
    with open(target, "r+b") as file:
        file.truncate(target.stat().st_size // 2)
    cut = runner.invoke(app, ["ask", str(target), CIRCLE])
    alone = runner.invoke(app, ["ask", str(target), CIRCLE, "--no-server"])
    assert cut.exit_code == alone.exit_code == 4 and cut.stderr == alone.stderr


def test_eight_clients_at_once_all_answer_right(server, packs):
    load = LoadOptions()
    options = AskOptions(generation=GenerationOptions(max_new_tokens=4))
    expected = {}
    for name in ("full", "rekv"):
        client = connect(server.place)
        expected[name] = RemoteSession(client, str(packs[name]), load).ask(CIRCLE, options).answer
        client.close()
    got, failures = [], []

    def one(number: int) -> None:
        name = ("full", "rekv")[number % 2]
        try:
            client = connect(server.place)
            session = RemoteSession(client, str(packs[name]), load)
            for _ in range(3):
                got.append((name, session.ask(CIRCLE, options).answer))
            session.close()
        except Exception as err:  # noqa: BLE001 (reported below)
            failures.append(repr(err))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures and len(got) == 24
    assert all(answer == expected[name] for name, answer in got)


def test_the_hot_packs_stay_under_the_cap_over_many_questions(packs, tmp_path, backbones):
    """1,000 questions across 20 packs under a cap of about three packs' KV."""
    copies = []
    for n in range(20):
        copies.append(tmp_path / f"p{n}.kvpack")
        shutil.copy(packs[("full", "mukv", "rekv")[n % 3]], copies[-1])
    warm = Warm(LoadOptions(device="cpu"))
    options = AskOptions(generation=GenerationOptions(max_new_tokens=1))
    probe = warm.session(copies[0])
    warm.ask(probe, CIRCLE, options)
    cap = 3 * warm.hot.held()
    warm.hot.cap = cap
    peak = 0
    for n in range(1000):
        session = warm.session(copies[(n * 7) % 20])
        warm.ask(session, CIRCLE, options)
        peak = max(peak, warm.hot.held())
    assert peak <= cap and 1 < len(warm.hot.packs) < 20
    warm.hot.cap = 1  # a pack alone over the cap: answered, then let go
    session = warm.session(copies[1])
    assert warm.ask(session, CIRCLE, options).answer
    assert warm.hot.held() == 0 and not warm.hot.packs
    warm.close()


def test_the_channel_is_private(server):
    folder, sock = server.place.folder, server.place.socket
    assert folder.stat().st_mode & 0o777 == 0o700 and sock.stat().st_mode & 0o777 == 0o600
    if os.getuid() == 0:  # another user, for real: nobody cannot reach the socket
        probe = subprocess.run(
            [sys.executable, "-c", _AS_NOBODY, str(sock)], capture_output=True, text=True
        )
        assert probe.stdout.strip() == "refused", probe.stderr


_AS_NOBODY = """
import os, socket, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1]); print("connected")
except PermissionError:
    print("refused")
"""


def test_a_peer_of_another_uid_is_refused(server, monkeypatch):
    """SO_PEERCRED: a connection whose peer is not the server's user gets one line, no answer."""
    import mmkv_cli.serve.local as local

    real = os.getuid()
    monkeypatch.setattr(local.os, "getuid", lambda: real + 1)
    client = connect(server.place)
    with pytest.raises(Exception, match="its own user only"):
        client.request("ping")
    client.close()


def test_a_server_dying_mid_answer_is_one_line_and_a_failure(tmp_path, packs, monkeypatch):
    """A server that sends part of an answer and dies: the part is shown, then the one line, and
    the exit is not 0 (no half answer passed off as whole)."""
    folder = _short_folder()
    path = folder / "mmkv.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)

    def die_mid_answer() -> None:
        conn, _ = listener.accept()
        channel = wire.Channel(conn)
        channel.receive()  # open
        channel.send({"event": "done", "media_kind": "video"})
        channel.receive()  # ask
        channel.send({"event": "token", "text": "re"})
        conn.close()

    threading.Thread(target=die_mid_answer, daemon=True).start()
    monkeypatch.setenv("MMKV_HOST", str(path))
    result = runner.invoke(app, ["ask", str(packs["full"]), CIRCLE])
    assert result.exit_code == 10 and result.stdout == "re\n"  # the error on a line of its own
    assert result.stderr.count("\n") == 1 and "stopped before answering" in result.stderr
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_two_servers_racing_one_wins(tmp_path):
    folder = _short_folder()
    place = Place(folder / "mmkv.sock")
    first = LocalServer(Warm(LoadOptions(device="cpu")), place)
    first.bind()
    with pytest.raises(AlreadyServing):
        LocalServer(Warm(LoadOptions(device="cpu")), place).bind()
    first.close()
    shutil.rmtree(folder, ignore_errors=True)


def _fresh_env(folder: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMKV_")}
    return {**env, "XDG_RUNTIME_DIR": str(folder), "HF_HUB_OFFLINE": "1", **extra}


def _mmkv(env: dict, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmkv_cli", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, input=stdin,
    )  # fmt: skip


def test_keep_alive_starts_one_server_for_racing_clients_found_without_flags(packs):
    """Fresh processes, no flags: keep_alive starts a server in the background; two clients at
    once start one between them; the client side imports neither torch, transformers, numpy nor
    the method registry or pack reader (the server reads the pack); a
    server killed outright leaves the next command to run in its own process."""
    folder = _short_folder()
    env = _fresh_env(folder, MMKV_KEEP_ALIVE="60")
    pack = str(packs["full"])
    racing = [
        subprocess.Popen(
            [sys.executable, "-m", "mmkv_cli", "ask", pack, CIRCLE],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )  # fmt: skip
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in racing]
    assert [p.returncode for p in racing] == [0, 0], outs
    assert [o[0] for o in outs] == ["red\n", "red\n"]
    state = json.loads(_mmkv(env, "ps", "--json").stdout)
    assert state["keep_alive_s"] == 60 and len(state["packs"]) == 1
    light = subprocess.run(
        [sys.executable, "-c", _CLIENT_ONLY, pack], capture_output=True, text=True, env=env,
        cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert light.stdout.strip().endswith("light"), light.stdout + light.stderr
    os.kill(state["pid"], 9)
    time.sleep(0.3)
    alone = _mmkv({**env, "MMKV_KEEP_ALIVE": "0"}, "ask", pack, CIRCLE)  # the socket left behind
    assert alone.returncode == 0 and alone.stdout == "red\n"
    shutil.rmtree(folder, ignore_errors=True)


_CLIENT_ONLY = """
import sys
from mmkv_cli.cli.app import main
sys.argv = ["mmkv", "ask", sys.argv[1], "what color is the circle ?"]
try:
    main()
except SystemExit as done:
    assert done.code == 0, done.code
# the server reads the pack and knows the methods: a client needs neither (nor numpy)
light = ("torch", "transformers", "numpy", "mmkv_cli.methods", "mmkv_cli.pack.access.reader")
heavy = [m for m in light if m in sys.modules]
print("light" if not heavy else f"imported {heavy}")
"""


def test_stop_ends_the_server_and_ps_says_none_runs(tmp_path):
    folder = _short_folder()
    env = _fresh_env(folder)
    started = subprocess.Popen(
        [sys.executable, "-m", "mmkv_cli", "serve", "--no-http"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    for _ in range(200):
        if (folder / "mmkv" / "mmkv.sock").exists():
            break
        time.sleep(0.05)
    second = _mmkv(env, "serve", "--no-http")
    assert second.returncode == 1 and "already answers" in second.stderr
    stopped = _mmkv(env, "stop")
    assert stopped.returncode == 0 and "stopped the mmkv server" in stopped.stdout
    assert started.wait(30) == 0
    none = _mmkv(env, "ps")
    assert none.returncode == 1 and none.stderr.startswith("error: no mmkv server runs")
    assert not (folder / "mmkv" / "mmkv.sock").exists()
    again = subprocess.Popen([sys.executable, "-m", "mmkv_cli", "serve", "--no-http"], env=env,
                             cwd=ROOT, stderr=subprocess.DEVNULL)  # fmt: skip
    for _ in range(200):
        if (folder / "mmkv" / "mmkv.sock").exists():
            break
        time.sleep(0.05)
    again.terminate()  # a TERM, as a service manager sends: the socket goes too
    assert again.wait(30) == 0 and not (folder / "mmkv" / "mmkv.sock").exists()
    shutil.rmtree(folder, ignore_errors=True)


_REFUSED_BEFORE_TORCH = """
import sys
from mmkv_cli.cli.entry import main
sys.argv = ["mmkv", *sys.argv[1:]]
try:
    main()
except SystemExit as done:
    code = done.code
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
sys.stdout.write(f"exit {code} {heavy}")
"""


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["ask", "missing.kvpack", CIRCLE], 4),
        (["ask", "{pack}", CIRCLE, "--temperature", "-1"], 2),
        (["chat", "missing.kvpack"], 4),
        (["encode", "missing.mp4", "-o", "x.kvpack", "--model", "demo"], 3),
        (["encode", str(SAMPLES / "clip.mp4"), "-o", "x.kvpack", "--method", "nope"], 2),
        (["live", "missing.ts", "-o", "y.kvpack", "--model", "demo"], 3),
        (["live", "missing.ts", "-o", "y.kvpack", "--method", "recency", "--budget", "0.5"], 2),
    ],
)
def test_a_refusal_comes_before_torch_is_imported(tmp_path, packs, args, code):
    args = [a.format(pack=packs["full"]) for a in args]
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_BEFORE_TORCH, *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert done.stdout == f"exit {code} []", done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_version_answers_before_the_cli_loads():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mmkv_cli", "--version"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stdout.startswith("mmkv ") and "mmkv_cli.cli.app" not in done.stderr


def test_log_flags_after_the_command_name_are_taken(packs):
    from typer.main import get_command

    from mmkv_cli.cli.app import _log_flags_first

    command = get_command(app)
    pack = str(packs["full"])
    assert _log_flags_first(command, ["ask", "-v", pack, "q", "-q"]) == [
        "-v",
        "-q",
        "ask",
        pack,
        "q",
    ]
    kept = ["ask", pack, "q", "--stop", "-q", "--", "-v"]  # a value, and after `--`: as given
    assert _log_flags_first(command, kept) == kept
    moved = _log_flags_first(command, ["ask", pack, CIRCLE, "-q", "--no-server"])
    quiet = runner.invoke(app, moved)  # as main() hands it on
    assert quiet.exit_code == 0 and quiet.stdout == "red\n"


def test_python_calls_in_a_loop_load_the_model_once(packs, tmp_path, monkeypatch):
    import mmkv
    import mmkv_cli.backbones.loading as loading

    loads = []
    real = loading.load_backbone
    monkeypatch.setattr(loading, "load_backbone", lambda load: loads.append(load) or real(load))
    mmkv.unload()
    for n in range(3):
        assert mmkv.ask(packs["full"], CIRCLE, device="cpu").answer == "red"
        mmkv.encode(SAMPLES / "clip.mp4", tmp_path / f"{n}.kvpack", model="demo", device="cpu")
    assert len(loads) == 1
    mmkv.unload()
    mmkv.ask(packs["full"], CIRCLE, device="cpu")
    assert len(loads) == 2


def test_serve_answers_http_and_this_users_commands_from_one_set_of_warm_models(packs):
    """`mmkv serve --packs DIR` opens the local channel beside HTTP: a pack asked over HTTP is hot
    for `mmkv ask`, and both use the one loaded model."""
    import httpx

    from tests.helpers import serving

    folder = _short_folder()
    shelf = folder / "packs"
    shelf.mkdir()
    shutil.copy(packs["rekv"], shelf / "clip.kvpack")
    env = _fresh_env(folder)
    with serving(str(shelf), runtime=str(folder)) as base:
        body = {"model": "clip", "messages": [{"role": "user", "content": CIRCLE}]}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        asked = _mmkv(env, "ask", str(shelf / "clip.kvpack"), CIRCLE, "--json")
        assert json.loads(asked.stdout)["bytes_read"] == 0  # hot from the HTTP question
        assert json.loads(asked.stdout)["answer"] == reply["choices"][0]["message"]["content"]
        state = json.loads(_mmkv(env, "ps", "--json").stdout)
        assert len(state["models"]) == 1 and state["packs"][0]["questions"] == 2
    shutil.rmtree(folder, ignore_errors=True)


def test_inspect_says_what_the_warm_server_holds_of_a_pack(server, packs, monkeypatch):
    pack = str(packs["mukv"])
    cold = json.loads(runner.invoke(app, ["inspect", pack, "--json"]).stdout)
    monkeypatch.setenv("MMKV_HOST", str(server.place.socket))
    assert runner.invoke(app, ["ask", pack, CIRCLE]).exit_code == 0
    hot = json.loads(runner.invoke(app, ["inspect", pack, "--json"]).stdout)
    assert "hot" not in cold and hot["hot"]["bytes"] > 0 and hot["hot"]["questions"] >= 1
    assert "in the warm server" in runner.invoke(app, ["inspect", pack]).stdout


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("streamingtom", {}),  # 4-bit by its own default
        ("full", {"kv_bits": 1.5}),  # VidKV's mixed bits
        ("h2o", {}),  # per KV head
        ("rekv", {}),  # retrieval layer by layer
        ("hermes", {"budget_tokens": 24}),
    ],
)
def test_a_hot_pack_gives_the_logits_of_a_fresh_read(tmp_path, backbones, method, options):
    """The same first-token logits from the held spans as from the file, question after question
    (and at a moment), for quantized, per-head and retrieval packs."""
    import torch

    pack = tmp_path / f"{method}.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", method, **options)
    warm = Warm(LoadOptions(device="cpu"))
    for at in (None, 2.0, None):
        asked = AskOptions(at=at, keep_logits=True, generation=GenerationOptions(max_new_tokens=2))
        hot = warm.ask(warm.session(pack), FIRST, asked)
        cold = PackSession(pack, backbone=warm.session(pack).backbone).ask(FIRST, asked)
        assert torch.equal(hot.first_logits, cold.first_logits) and hot.answer == cold.answer
        assert hot.blocks_used == cold.blocks_used
    assert hot.bytes_read == 0 < cold.bytes_read
    warm.close()


def test_a_runtime_folder_others_may_enter_is_never_connected_to(monkeypatch, packs, tmp_path):
    """A folder at the server's place that is not this user's alone: the command runs here and
    says why, in one line, at -v; it never talks to a socket there."""
    folder = _short_folder()
    (folder / "mmkv").mkdir(mode=0o755)
    (folder / "mmkv").chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    result = runner.invoke(app, ["ask", str(packs["full"]), CIRCLE])
    assert result.exit_code == 0 and result.stdout == "red\n"
    presets = tmp_path / "mine"
    (presets / "methods").mkdir(parents=True)
    monkeypatch.setenv("MMKV_PRESETS", str(presets))
    from mmkv_cli.cli.server import _own_presets

    assert _own_presets()  # a command with presets of its own runs here
    shutil.rmtree(folder, ignore_errors=True)


def test_ctrl_c_mid_answer_leaves_nothing_for_the_next_question(server, packs):
    """chat's Ctrl-C stops an answer: the rest of it never reaches the next question's output."""
    client = connect(server.place)
    session = RemoteSession(client, str(packs["full"]), LoadOptions())
    options = AskOptions(generation=GenerationOptions(max_new_tokens=8))
    expected = session.ask(FIRST, options).answer

    def stop(piece: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.ask(CIRCLE, options, on_token=stop)
    pieces: list[str] = []
    again = session.ask(FIRST, options, on_token=pieces.append)
    assert again.answer == expected and "".join(pieces).strip() == expected
    session.close()


@pytest.mark.parametrize(
    ("args", "env", "code", "line"),
    [
        (["ps"], {"MMKV_HOST": "tcp://h:1"}, 2, "MMKV_HOST must name a server's socket"),
        (
            ["ask", "{pack}", CIRCLE],
            {"MMKV_HOST": "/nonexistent/mmkv.sock"},
            2,
            "no mmkv server answers at /nonexistent/mmkv.sock",
        ),
        (
            ["ask", "{pack}", CIRCLE],
            {"MMKV_KEEP_ALIVE": "soon"},
            2,
            "MMKV_KEEP_ALIVE must be a duration",
        ),
        (["serve", "--no-http", "--cache-gb", "0"], {}, 2, "--cache-gb must be above 0"),
        (["serve", "--no-http", "--keep-alive", "later"], {}, 2, "--keep-alive must be a duration"),
        (["serve", "--no-http"], {"MMKV_HOST": "/tmp/" + "x" * 120}, 2, "the socket path /tmp/xxx"),
    ],
)
def test_the_warm_servers_refusals_are_one_line(tmp_path, packs, args, env, code, line):
    folder = _short_folder()
    argv = [a.format(pack=packs["full"]) for a in args]
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_BEFORE_TORCH, *argv],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**_fresh_env(folder), **env},
    )  # fmt: skip
    assert done.stdout == f"exit {code} []", done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {line}") and done.stderr.count("\n") == 1, done.stderr
    shutil.rmtree(folder, ignore_errors=True)


def test_a_pack_over_the_whole_cap_is_read_as_the_plain_reader_reads_it(tmp_path, backbones):
    """Never held, so never read block by whole block: the rows a question takes, as a fresh
    reader reads them (retrieval by layer, 2 blocks a layer, reads those layers' rows alone),
    and nothing kept after."""
    from mmkv_cli.core.options import MethodSpec

    pack = tmp_path / "rekv-2.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), pack, "demo", MethodSpec("rekv", {"k": 2}))
    warm = Warm(LoadOptions(device="cpu"), cache_bytes=1)
    options = AskOptions(generation=GenerationOptions(max_new_tokens=2))
    hot = warm.ask(warm.session(pack), FIRST, options)
    fresh = PackSession(pack, backbone=warm.session(pack).backbone)
    cold = fresh.ask(FIRST, options)
    assert hot.bytes_read == cold.bytes_read > 0 and hot.answer == cold.answer
    assert warm.hot.held() == 0
    warm.close()
