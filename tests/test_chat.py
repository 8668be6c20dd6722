"""`mmkv chat`: answers stream, follow-ups see earlier turns within the limits, commands change the
next question's options, and a bad line never ends the chat."""

import subprocess
import sys

import pytest

from mmkv_cli import api
from mmkv_cli.cli.chat import Chat, chat_loop, recent_turns
from mmkv_cli.core.options import AskOptions, GenerationOptions
from tests.conftest import ROOT, SAMPLES
from tests.helpers import encode_pack


@pytest.fixture(scope="module")
def session(tmp_path_factory, backbones):
    pack = tmp_path_factory.mktemp("chat") / "p.kvpack"
    backbone = backbones["tiny-llava-ov"]
    encode_pack(SAMPLES / "clip.mp4", pack, method="full", backbone=backbone, max_frames=8)
    return api.PackSession(pack, backbone=backbone)


def _run(session, lines, **limits):
    chat = Chat(AskOptions(generation=GenerationOptions(3)), **limits)
    out, notes, asked = [], [], []
    ask = session.ask

    def spy(question, options, on_token=None):
        answer = ask(question, options, on_token)
        asked.append((question, options, answer))
        return answer

    session.ask = spy
    try:
        chat_loop(
            session, lines, chat, out.append, notes.append, lambda a: notes.append("explained")
        )
    finally:
        del session.ask
    return chat, "".join(out), notes, asked


def test_follow_ups_see_the_earlier_turns_and_commands_apply_to_the_next_question(session):
    lines = [
        "what color is the circle ?",
        "and then ?",
        "/at 1",
        "/prune snapkv 0.5",
        "/explain",
        "what shape ?",
        "/reset",
        "last one ?",
        "/quit",
        "never asked",
    ]
    chat, out, notes, asked = _run(session, lines)
    assert [q for q, _, _ in asked] == [
        "what color is the circle ?",
        "and then ?",
        "what shape ?",
        "last one ?",
    ]
    first, second, third, fourth = (a for _, _, a in asked)
    assert asked[1][1].history == (("what color is the circle ?", first.answer),)
    template = session.reader.header.prompt.question
    turn = len(session.backbone.turns_ids(asked[1][1].history, template))
    length = [len(session.backbone.question_ids(q, template)) for q, _, _ in asked[:2]]
    assert second.context_tokens == first.context_tokens - length[0] + turn + length[1]
    assert asked[2][1].at == 1.0 and asked[2][1].prune == "snapkv" and len(asked[2][1].history) == 2
    assert third.kv_tokens is not None  # pruned
    assert asked[3][1].history == ()  # after /reset
    assert "explained" in notes and out.count("\n") == 4
    assert chat.history[-1][0] == "last one ?"


def test_bad_commands_and_values_are_one_line_and_the_chat_goes_on(session):
    lines = [
        "/at soon",
        "/at -1",
        "/prune hermes 0.5",
        "/prune snapkv 2",
        "/frob",
        "/explain",
        "ok ?",
    ]
    _, _, notes, asked = _run(session, lines)
    errors = [n for n in notes if n.startswith("error:")]
    assert len(errors) == 5 and all("\n" not in e for e in errors)
    assert "nothing asked yet" in notes and [q for q, _, _ in asked] == ["ok ?"]


def test_the_history_is_cut_to_its_turn_and_token_limits(session):
    chat = Chat(AskOptions(), turns=3, tokens=10_000)
    chat.history = [(f"question {i} ?", f"answer {i}") for i in range(6)]
    assert [q for q, _ in recent_turns(session, chat)] == [
        "question 3 ?",
        "question 4 ?",
        "question 5 ?",
    ]
    one = len(session.backbone.turns_ids((chat.history[-1],)))
    chat.tokens = one  # room for the newest turn only
    assert recent_turns(session, chat) == chat.history[-1:]
    chat.turns = 0
    assert recent_turns(session, chat) == []


def test_chat_reads_piped_lines_in_a_real_process(tmp_path, backbones):
    pack = tmp_path / "d.kvpack"
    encode_pack(SAMPLES / "clip.mp4", pack, "demo", max_frames=16)
    done = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "chat", str(pack), "--max-new-tokens", "4"],
        input="what color is the circle ?\n/nope\nwhat shape is it ?\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    answers = done.stdout.strip().splitlines()
    assert len(answers) == 2 and answers[0] == "red"
    assert "unknown command /nope" in done.stderr
    long = "why " * 6000  # over 20,000 characters: refused, and the chat goes on
    done = subprocess.run(
        [sys.executable, "-m", "mmkv_cli", "chat", str(pack), "--max-new-tokens", "4"],
        input=f"{long}\nwhat color is the circle ?\n",
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1 and done.stdout.strip() == "red"  # one question got no answer
    for bad in ("nan", "-1"):
        refused = subprocess.run(
            [sys.executable, "-m", "mmkv_cli", "chat", str(pack), "--temperature", bad],
            input="",
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert refused.returncode == 2 and "--temperature" in refused.stderr, refused.stderr


def test_ctrl_c_stops_the_answer_in_flight_and_the_chat_goes_on(session):
    """Issue 39, item 5: as ollama's REPL does; the stopped turn is not kept as history."""
    chat = Chat(AskOptions(generation=GenerationOptions(3)))
    ask, calls, notes = session.ask, [], []

    def interrupted_once(question, options, on_token=None):
        calls.append(question)
        if len(calls) == 1:
            on_token("half an ans")
            raise KeyboardInterrupt
        return ask(question, options, on_token)

    session.ask = interrupted_once
    try:
        chat_loop(session, ["first ?", "second ?"], chat, lambda _: None, notes.append, print)
    finally:
        del session.ask
    assert calls == ["first ?", "second ?"] and [q for q, _ in chat.history] == ["second ?"]
    assert any("stopped" in n for n in notes) and chat.failed == 0
