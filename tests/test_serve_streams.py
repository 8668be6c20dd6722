"""`mmkv serve` hosts live streams beside packs: started by POST /v1/streams, asked by name through
the chat completions like a pack (the openai client), shown by GET, stopped by DELETE, which keeps
the pack the shelf then serves."""

import threading
import time

import httpx
import openai

import mmkv
from mmkv import methods
from mmkv_cli.api import stored_method
from mmkv_cli.pack import PackReader
from tests.conftest import SAMPLES
from tests.helpers import encode_pack, mpegts_bytes, serving


def test_a_stream_is_started_asked_shown_and_stopped_into_a_pack(tmp_path):
    folder = tmp_path / "packs"
    folder.mkdir()
    data = mpegts_bytes(SAMPLES / "clip.mp4")
    growing = tmp_path / "cam.ts"
    growing.write_bytes(data[: len(data) // 3])
    finished = threading.Event()

    def record():  # the rest of the recording, slowly, then the camera keeps still
        for start in range(len(data) // 3, len(data), 2048):
            if finished.is_set():
                return
            with growing.open("ab") as fh:
                fh.write(data[start : start + 2048])
            time.sleep(0.05)

    writer = threading.Thread(target=record, daemon=True)
    with serving(str(folder)) as base:
        http = httpx.Client(base_url=base, timeout=120)
        request = {"name": "cam", "source": str(growing), "model": "demo", "fps": 2.0}
        refused = http.post("/v1/streams", json={**request, "method": "recency"})
        said = refused.json()["error"]["message"]  # the request's own field, not the CLI's flag
        assert refused.status_code == 400 and "budget_tokens" in said and "--" not in said
        wrong = {"name": "hermes", "params": {"deep_share": 3}}
        refused = http.post("/v1/streams", json={**request, "method": wrong, "budget_tokens": 24})
        assert refused.status_code == 400
        assert "deep_share: 3.0 is above the maximum 1" in refused.json()["error"]["message"]
        hermes = methods.HERMES(deep_share=0.5, summary=False).spec()  # as Python sends one
        typed = {"name": hermes.name, "params": dict(hermes.params)}
        started = http.post(
            "/v1/streams", json={**request, "method": typed, "budget_tokens": 24, "stall": 30}
        )
        assert started.status_code == 201, started.text
        writer.start()
        taken = http.post("/v1/streams", json={**request, "budget_tokens": 24})
        assert taken.status_code == 409, taken.text  # the name is a running stream's
        deadline = time.monotonic() + 90
        while http.get("/v1/streams/cam").json()["frames"] < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="cam", messages=[{"role": "user", "content": "what color is the circle ?"}]
        )
        assert reply.choices[0].message.content and reply.usage.prompt_tokens > 0
        assert reply.model_extra["mmkv"]["moment"] >= 1.5  # the memory at the question's moment
        streamed = client.chat.completions.create(
            model="cam", messages=[{"role": "user", "content": "which shape ?"}], stream=True
        )
        chunks = [c for c in streamed if c.choices]
        assert chunks[0].choices[0].delta.role == "assistant"  # OpenAI's first chunk: the role
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        state = http.get("/v1/streams/cam").json()
        assert state["state"] == "running" and state["method"] == "hermes"
        assert state["pack"] == "cam.kvpack" and str(folder) not in str(state)  # no server path
        listed = {m.id: m for m in client.models.list()}  # a running stream is a model to pick
        assert listed["cam"].model_extra["mmkv"]["stream"]["state"] == "running"
        assert list(listed).count("cam") == 1
        stopped = http.delete("/v1/streams/cam").json()
        finished.set()
        assert stopped["state"] == "stopped" and stopped["frames"] >= 4
        assert http.get("/v1/streams/nope").status_code == 404
        # the stream's pack is a pack like any other now
        again = client.chat.completions.create(
            model="cam", messages=[{"role": "user", "content": "what color is the circle ?"}]
        )
        assert again.choices[0].message.content
        assert "cam" in {m.id for m in client.models.list()}
    _, params = stored_method(PackReader(folder / "cam.kvpack"))  # the object's values
    assert params.deep_share == 0.5 and params.summary is False


def test_preload_loads_the_model_before_health_answers(tmp_path):
    folder = tmp_path / "packs"
    folder.mkdir()
    with serving(str(folder), "--model", "demo", "--preload") as base:
        health = httpx.get(f"{base}/health", timeout=30).json()
    assert health["status"] == "ok" and health["models_loaded"] == ["demo"]


def test_preload_loads_the_model_its_packs_name_or_says_why_not_in_one_line(tmp_path, backbones):
    """Issue 75, row 3: serving.md's own block, packs made with the demo and no --model: the
    demo is what loads; a model that cannot load is one line and exit 5, never a traceback."""
    from tests.helpers import encode_pack, run_mmkv

    folder = tmp_path / "packs"
    folder.mkdir()
    encode_pack(str(SAMPLES / "clip.mp4"), folder / "clip.kvpack", "demo", "recency", budget=0.5)
    with serving(str(folder), "--preload") as base:
        health = httpx.get(f"{base}/health", timeout=30).json()
    assert health["models_loaded"] == ["demo"]
    refused = run_mmkv(
        "serve", "--packs", str(folder), "--port", "0", "--no-local", "--preload", "--model",
        "llava-ov-0.5b", env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert refused.returncode == 5 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: model 'llava-ov-0.5b'")


def test_a_stream_runs_the_packs_model_and_is_refused_for_its_fields_first(tmp_path):
    """A server of demo packs started without --model: a stream naming no model runs the demo
    (not the default checkpoint, absent here); a wrong field is refused before any model loads,
    named as the JSON field; a name a pack holds is a conflict."""
    folder = tmp_path / "packs"
    folder.mkdir()
    encode_pack(SAMPLES / "clip.mp4", folder / "clip.kvpack", "demo", "full", max_frames=4)
    source = str(SAMPLES / "clip.mp4")
    with serving(str(folder)) as base:
        http = httpx.Client(base_url=base, timeout=120)
        absent = {"name": "cam", "source": source, "model": "llava-ov-0.5b", "method": "recency"}
        refused = http.post("/v1/streams", json=absent)  # its budget, before its model
        said = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "a token count, budget_tokens" in said, said
        taken = http.post("/v1/streams", json={"name": "clip", "source": source})
        assert taken.status_code == 409 and "a pack named 'clip' exists" in taken.text
        started = http.post("/v1/streams", json={"name": "cam", "source": source, "stall_s": 1})
        assert started.status_code == 201, started.text
        deadline = time.monotonic() + 60
        while http.get("/v1/streams/cam").json()["state"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert http.get("/v1/streams/cam").json()["frames"] == 16  # the whole clip, by the demo
    assert mmkv.inspect(str(folder / "cam.kvpack")).model == "demo"
