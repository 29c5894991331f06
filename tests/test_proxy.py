"""``kvplane proxy``: vLLM's disaggregated protocol (P with max_tokens 1 and
do_remote_decode, then D with P's kv_transfer_params), streamed or not, for
completions and chat, round robin over several engines, and a 502 with a JSON
body for an engine that is down or answers badly.

The engines are small ASGI apps that answer as vLLM does, reached through
httpx's ASGI transport (no ports); one test points the proxy at a closed
loopback port, a real unreachable engine."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from kvplane.app.vllm.proxy import make_app

REPO = Path(__file__).resolve().parent.parent
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}


class Engines:
    """Fake vLLM servers, one per host name: what each received, and how P answers."""

    def __init__(self, prefill_answer=None, prefill_status=200):
        self.seen: list[tuple[str, str, dict]] = []  # (host, path, body)
        self.prefill_answer = prefill_answer if prefill_answer is not None else {"kv_transfer_params": PARAMS}
        self.prefill_status = prefill_status

    def app(self) -> Starlette:
        async def answer(request: Request):
            body = await request.json()
            host = request.url.hostname
            self.seen.append((host, request.url.path, body))
            if host.startswith("p"):
                if callable(self.prefill_answer):  # params of this engine's own
                    return JSONResponse(self.prefill_answer(host))
                if isinstance(self.prefill_answer, str):
                    return PlainTextResponse(self.prefill_answer, status_code=self.prefill_status)
                return JSONResponse(self.prefill_answer, status_code=self.prefill_status)
            if body.get("stream"):
                async def sse():
                    for tok in ("a", "b"):
                        yield f"data: {json.dumps({'choices': [{'text': tok}], 'from': host})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                return StreamingResponse(sse(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"text": "ab"}], "from": host,
                                 "got": body.get("kv_transfer_params")})

        return Starlette(routes=[Route(p, answer, methods=["POST"])
                                 for p in ("/v1/completions", "/v1/chat/completions")])


def proxy(engines: Engines, prefills=("http://p0:8100",), decodes=("http://d0:8200",)) -> TestClient:
    app = make_app(list(prefills), list(decodes), timeout=10.0, transport=httpx.ASGITransport(app=engines.app()))
    return TestClient(app)


def test_completion_goes_to_p_then_d_with_ps_params():
    engines = Engines()
    with proxy(engines) as client:
        resp = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "stream_options": {"x": 1},
                                                    "min_tokens": 2})
    assert resp.status_code == 200 and resp.json()["got"] == PARAMS
    (p_host, p_path, p_body), (d_host, _, d_body) = engines.seen
    assert (p_host, p_path, d_host) == ("p0", "/v1/completions", "d0")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert d_body["max_tokens"] == 8 and d_body["min_tokens"] == 2 and d_body["kv_transfer_params"] == PARAMS


def test_chat_streams_ds_chunks():
    engines = Engines()
    with proxy(engines) as client:
        with client.stream("POST", "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                 "max_completion_tokens": 5}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and [json.loads(x[5:])["choices"][0]["text"] for x in lines[:-1]] == ["a", "b"]
    p_body = engines.seen[0][2]
    assert engines.seen[0][1] == "/v1/chat/completions" and p_body["max_completion_tokens"] == 1


def test_several_engines_round_robin():
    engines = Engines()
    with proxy(engines, prefills=("http://p0:1", "http://p1:1"), decodes=("http://d0:1", "http://d1:1",
                                                                          "http://d2:1")) as client:
        for _ in range(6):
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    hosts = [h for h, _, _ in engines.seen]
    assert [h for h in hosts if h.startswith("p")] == ["p0", "p1"] * 3
    assert [h for h in hosts if h.startswith("d")] == ["d0", "d1", "d2"] * 2


def test_each_decode_leg_carries_the_params_of_the_prefill_engine_that_answered_it():
    """With several prefill engines, D must read from the P that prefilled
    the request: the params it gets are that P's (its engine id), request by request."""
    engines = Engines(prefill_answer=lambda host: {"kv_transfer_params": dict(PARAMS, remote_engine_id=host)})
    with proxy(engines, prefills=("http://p0:1", "http://p1:1", "http://p2:1")) as client:
        got = [client.post("/v1/completions", json={"prompt": "x"}).json()["got"] for _ in range(6)]
    assert [g["remote_engine_id"] for g in got] == ["p0", "p1", "p2"] * 2
    prefilled = [h for h, _, _ in engines.seen if h.startswith("p")]
    decoded = [b["kv_transfer_params"]["remote_engine_id"] for h, _, b in engines.seen if h.startswith("d")]
    assert prefilled == decoded


@pytest.mark.parametrize("answer, status, says", [
    ({"choices": []}, 200, "without kv_transfer_params"),
    ("not json", 200, "not a JSON object"),
    ("boom", 500, "answered 500: boom"),
])
def test_a_bad_prefill_answer_is_a_502_with_json(answer, status, says):
    engines = Engines(prefill_answer=answer, prefill_status=status)
    with proxy(engines) as client:
        resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 502
    err = resp.json()["error"]
    assert says in err["message"] and err["leg"] == "prefill" and err["upstream"] == "http://p0:8100"
    assert [h for h, _, _ in engines.seen] == ["p0"]  # D was never asked


def test_a_client_error_from_the_engine_is_passed_back():
    engines = Engines(prefill_answer={"error": {"message": "max_tokens must be >= 1"}}, prefill_status=400)
    with proxy(engines) as client:
        resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"]


def test_an_unreachable_engine_is_a_502_not_an_empty_reply():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    app = make_app([f"http://127.0.0.1:{closed}"], ["http://127.0.0.1:1"], timeout=5.0)
    with TestClient(app) as client:
        resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 502
    assert "unreachable" in resp.json()["error"]["message"] and resp.json()["error"]["leg"] == "prefill"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]"])
def test_a_bad_request_body_is_a_400(body):
    with proxy(Engines()) as client:
        resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()


@pytest.mark.parametrize("args, says", [
    (["--port", "70000"], "not a port"),
    (["--port", "x"], "not a port number"),
    (["--prefill", "ftp://h:1"], "http(s)://host:port"),
    (["--timeout", "nan"], "finite"),
])
def test_bad_proxy_options_exit_2(args, says):
    argv = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200", *args]
    done = subprocess.run([sys.executable, "-m", "kvplane.app.cli", "proxy", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr


def test_the_jobs_client_sends_one_request_id_to_p_and_d():
    """``disaggregated`` (the vLLM job's client): both legs carry the same
    X-Request-Id, as vLLM's toy proxy sends: NixlPushConnector's P matches
    D's PUSH_REG to its finished request by it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvplane.app.vllm.proxy import disaggregated

    seen: list[tuple[str, str | None]] = []

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.server.name, self.headers.get("X-Request-Id")))
            self.send_response(200)
            if body.get("stream"):
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(b'data: {"choices": [{"token_ids": [5]}]}\n\ndata: [DONE]\n\n')
            else:
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps({"kv_transfer_params": PARAMS}).encode())

        def log_message(self, *args):
            pass

    servers = []
    for name in ("P", "D"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        for _ in range(2):
            got = disaggregated(*urls, {"prompt": [1, 2], "max_tokens": 2}, timeout=10)
            assert got.text_tokens == (5,) and got.kv_transfer_params == PARAMS
    finally:
        for s in servers:
            s.shutdown()
    (p1, d1), (p2, d2) = seen[:2], seen[2:]
    assert p1[0] == "P" and d1[0] == "D" and p1[1] and p1[1] == d1[1]
    assert p2[1] == d2[1] != p1[1]  # one id per request
