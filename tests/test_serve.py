"""`mmkv serve`: a live server on loopback answers the openai client (plain and streamed) exactly as
`ask` does, 8 concurrent streams match a sequential run, and bad requests get the right status while
the server stays up."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from mmkv_cli import api
from mmkv_cli.pack import FORMAT_VERSION
from tests.conftest import SAMPLES
from tests.helpers import encode_pack, serving

QUESTIONS = ["what color is the circle ?", "which shape appeared first ?", "what happened last ?"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    encode_pack(SAMPLES / "clip.mp4", folder / "clip.kvpack", "demo")
    encode_pack(SAMPLES / "clip.mp4", folder / "clip-mukv.kvpack", "demo", "mukv")
    outside = tmp_path_factory.mktemp("outside")
    encode_pack(SAMPLES / "clip.mp4", outside / "secret.kvpack", "demo")
    (folder / "escape.kvpack").symlink_to(outside / "secret.kvpack")  # a link out of the folder
    return folder


@pytest.fixture(scope="module")
def server(packs):
    with serving(str(packs)) as base:
        yield base


@pytest.fixture(scope="module")
def expected(packs):
    """What `ask` answers in this process, the reference for every served answer."""
    session = {name: api.PackSession(packs / f"{name}.kvpack") for name in ("clip", "clip-mukv")}
    return {(name, q): s.ask(q).answer for name, s in session.items() for q in QUESTIONS}


def test_the_openai_client_gets_asks_answers_plain_and_streamed(server, expected):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {"clip", "clip-mukv"}  # the link is not listed
    for (name, question), answer in expected.items():
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], max_tokens=32
        )
        assert reply.choices[0].message.content == answer
        assert reply.choices[0].finish_reason == "stop" and reply.usage.prompt_tokens > 0
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces).strip() == answer


def test_eight_concurrent_streams_get_the_sequential_answers(server, expected):
    jobs = [(name, q) for name, q in expected] * 2
    jobs = jobs[:8]
    got: dict[int, str] = {}

    def one(i: int, name: str, question: str) -> None:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], stream=True
        )
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got.get(i) for i in range(len(jobs))] == [expected[job] for job in jobs]


def test_the_other_endpoints_and_extra_fields(server, packs):
    info = httpx.get(f"{server}/v1/packs/clip").json()
    local = api.inspect((packs / "clip.kvpack").resolve())
    media = {**local["media"], "source": "clip.mp4"}  # no path of the server's, nor the encoder's
    assert info == json.loads(json.dumps({**local, "path": "clip.kvpack", "media": media}))
    assert str(packs.resolve()) not in json.dumps(info)
    reply = httpx.post(
        f"{server}/v1/chat/completions",
        json={
            "model": "clip-mukv",
            "messages": [{"role": "user", "content": QUESTIONS[0]}],
            "explain": True,
            "at": 1.5,
        },
        timeout=120,  # run alone, this request loads the model
    ).json()
    retrieved = reply["mmkv"]["retrieved"]
    assert retrieved and all(r["time"][1] <= 1.5 for r in retrieved)  # no frame after it
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["models_loaded"] == ["demo"]


@pytest.mark.parametrize(
    "request_args, status",
    [
        (
            {
                "content": b'{"model": "clip", "messages": [',
                "headers": {"content-type": "application/json"},
            },
            400,
        ),
        ({"json": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}}, 404),
        ({"json": {"model": "../clip", "messages": [{"role": "user", "content": "hi"}]}}, 404),
        ({"json": {"model": "/etc/passwd", "messages": [{"role": "user", "content": "hi"}]}}, 404),
        ({"json": {"model": "escape", "messages": [{"role": "user", "content": "hi"}]}}, 404),
        ({"json": {"model": "clip", "messages": []}}, 400),
        (
            {
                "json": {
                    "model": "clip",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 0,
                }
            },
            400,
        ),
        ({"json": {"model": "clip", "messages": [{"role": "assistant", "content": "hi"}]}}, 400),
        ({"content": b"x" * (2 << 20), "headers": {"content-type": "application/json"}}, 413),
    ],
)
def test_bad_requests_get_their_status_and_the_server_stays_up(server, request_args, status):
    reply = httpx.post(f"{server}/v1/chat/completions", timeout=30, **request_args)
    assert reply.status_code == status, reply.text
    body = reply.json()["error"]
    message = body["message"]
    assert message and "\n" not in message and "Traceback" not in message
    assert set(body) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert body["code"] is None or isinstance(body["code"], str)
    assert httpx.get(f"{server}/health").status_code == 200
    for name in ("..", "..%2Fsecret", "escape"):
        assert httpx.get(f"{server}/v1/packs/{name}").status_code == 404


def _in_process(packs, **options):
    from mmkv_cli.serve.app import create_app

    app = create_app(packs, **options)
    transport = httpx.ASGITransport(
        app=app, raise_app_exceptions=False
    )  # a served 500 stays a reply
    return app, httpx.AsyncClient(transport=transport, base_url="http://mmkv")


def test_a_key_is_required_when_set(packs):
    async def go():
        _, client = _in_process(packs, api_key="sesame")
        async with client:
            assert (await client.get("/health")).status_code == 200  # open, for probes
            version = await client.get("/version")
            assert version.status_code == 200 and version.json()["format_version"] == FORMAT_VERSION
            refused = await client.get("/v1/models")
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            wrong = {"Authorization": "Bearer nope"}
            assert (await client.get("/v1/models", headers=wrong)).status_code == 401
            right = {"Authorization": "Bearer sesame"}
            assert (await client.get("/v1/models", headers=right)).status_code == 200
            # request counts, latencies and load are the server's business: the key's too
            assert (await client.get("/metrics")).status_code == 401
            scraped = await client.get("/metrics", headers=right)
            assert scraped.status_code == 200 and "mmkv_requests_total" in scraped.text
        _, scraper = _in_process(packs, api_key="sesame", open_metrics=True)
        async with scraper:  # --open-metrics: for a scraper that cannot send a key
            assert (await scraper.get("/metrics")).status_code == 200
            assert (await scraper.get("/v1/models")).status_code == 401

    asyncio.run(go())


def test_a_full_queue_answers_503_with_retry_after(packs):
    class Slow:
        backbone = None

        def ask(self, question, options, on_token=None):
            time.sleep(1.5)  # long enough for the next requests to find the line full
            raise AssertionError("not reached by the refused request")

    async def go():
        app, client = _in_process(packs, queue=1)
        app.state.packs.ask = lambda name, question, options, on_token=None: Slow().ask(
            question, options
        )
        body = {"model": "clip", "messages": [{"role": "user", "content": "hi"}]}
        async with client:
            first = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            await asyncio.sleep(0.1)
            refused = await client.post("/v1/chat/completions", json=body)
            streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert streamed.status_code == 503
            assert (await first).status_code == 500  # the slow job's own failure, one line
            assert json.loads((await first).text)["error"]["message"].startswith("internal error")

    asyncio.run(go())


def test_a_model_switch_evicts_the_oldest_backbone_by_the_cap(packs, monkeypatch):
    import mmkv_cli.backbones.loading as backbones_module
    from mmkv_cli.core.options import LoadOptions
    from mmkv_cli.serve.packs import Packs
    from mmkv_cli.serve.shelf import shelf

    class Fake:
        def __init__(self, layers: int):
            self.layers = layers

        def kv_shape(self) -> dict:
            return {"layers": self.layers}

    monkeypatch.setattr(backbones_module, "load_backbone", lambda load: Fake(load.layers or 2))
    held = Packs(shelf(packs), LoadOptions(), models=1)
    first = held.backbone(LoadOptions("a"))
    assert held.backbone(LoadOptions("a")) is first  # a hit keeps it, its depth unsaid or said
    assert held.backbone(LoadOptions("a", layers=2)) is first
    held.backbone(LoadOptions("a", layers=1))  # another depth of a rehearsal model: its own
    assert [(k.model, k.layers) for k in held.backbones] == [("a", 1)]


def test_openai_compatible_without_surprises(server, packs):
    """Issue 39, item 4: models by id, errors in OpenAI's shape, unsupported fields refused by name,
    usage in streams, CORS only when asked, Prometheus metrics."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.retrieve("clip")
    assert model.id == "clip" and model.created > 1_700_000_000  # when the pack was written
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    for method, path, status in (("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405)):
        reply = httpx.request(method, f"{server}{path}")
        assert reply.status_code == status and reply.json()["error"]["message"], reply.text
    say = [{"role": "user", "content": QUESTIONS[0]}]
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    for extra, named in (
        ({"n": 2}, "n is not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": image}]}, "image_url parts"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        body = {"model": "clip", "messages": say, **extra}
        reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 400 and named in reply.json()["error"]["message"], reply.text
    stream = client.chat.completions.create(
        model="clip", messages=say, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []
    preflight = {"Origin": "http://page.example", "Access-Control-Request-Method": "POST"}
    assert httpx.options(f"{server}/v1/chat/completions", headers=preflight).status_code != 200
    metrics = httpx.get(f"{server}/metrics").text
    assert 'mmkv_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    assert "mmkv_time_to_first_token_seconds_count" in metrics and "mmkv_queue_depth" in metrics


def test_system_messages_are_used_and_cors_is_opt_in(packs):
    from mmkv_cli.serve.requests import ChatRequest

    body = ChatRequest(
        model="clip",
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "what color is the circle ?"},
        ],
    )
    assert body.conversation()[0] == "Answer in one word.\n\nwhat color is the circle ?"

    async def preflight():
        app, client = _in_process(packs, cors=["http://page.example"])
        async with client:
            return await client.options(
                "/v1/chat/completions",
                headers={"Origin": "http://page.example", "Access-Control-Request-Method": "POST"},
            )

    reply = asyncio.run(preflight())
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "http://page.example"


def test_serve_refuses_an_unknown_host_and_a_taken_port_in_one_line():
    """Issue 40 item 12 and issue 39 item 4: checked when the socket is bound, before any pack is
    read; exit 8, not a uvicorn traceback or exit 3."""
    import socket

    from typer.testing import CliRunner

    from mmkv_cli.cli.app import app

    runner = CliRunner()
    bad = runner.invoke(app, ["serve", "--packs", ".", "--host", "not..a..host"])
    assert bad.exit_code == 8 and "not an address of this machine" in bad.stderr, bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        busy = runner.invoke(app, ["serve", "--packs", ".", "--port", port])
    assert busy.exit_code == 8 and f"127.0.0.1:{port} is taken" in busy.stderr, busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1


def test_an_unknown_model_and_a_bad_field_are_named_as_openai_names_them(packs):
    async def go():
        _, client = _in_process(packs)
        async with client:
            asked = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
            missing = (await client.post("/v1/chat/completions", json=asked)).json()["error"]
            assert (missing["param"], missing["code"]) == ("model", "model_not_found")
            bad = {**asked, "model": 5}
            wrong = (await client.post("/v1/chat/completions", json=bad)).json()["error"]
            assert wrong["param"] == "model" and wrong["code"] is None

    asyncio.run(go())
