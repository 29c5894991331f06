"""A proxy speaking vLLM's disaggregated-serving protocol.

Each completion goes to P first with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; P's response carries
the ``kv_transfer_params`` that tell D where the prompt's KV is; the same
request then goes to D with them, and D's answer is the client's.  This is
the protocol of vLLM's own toy proxy, so kvplane's connector and vLLM's
NixlConnector are driven the same way.

``disaggregated`` is the protocol (the main job calls it directly, timing
each leg); ``serve`` wraps it in an HTTP server (``kvplane proxy``).  Only
``/v1/completions`` without streaming to the client: enough for a
benchmark and a demo, and a clear 400 for anything else.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import attrs


class ProxyError(RuntimeError):
    """A leg failed: which one, and the engine's answer."""

    def __init__(self, leg: str, status: int | None, message: str):
        self.leg = leg
        self.status = status
        super().__init__(f"{leg}: {status or 'no answer'}: {message}")


@attrs.frozen
class Disaggregated:
    """One request's two legs."""

    prefill: dict  # P's response body
    kv_transfer_params: dict | None
    text_tokens: tuple[int, ...]  # D's generated token ids (the request asks for return_token_ids)
    decode: dict  # D's response body (non-streaming) or the last chunk (streaming)
    p_seconds: float  # P leg, send to response
    d_ttft_seconds: float  # D leg, send to first token
    d_seconds: float  # D leg, send to last byte


def post_json(url: str, body: dict, *, timeout: float, leg: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ProxyError(leg, exc.code, exc.read().decode(errors="replace")[:500]) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise ProxyError(leg, None, str(exc)) from None


def stream_completion(url: str, body: dict, *, timeout: float, leg: str) -> tuple[list[dict], float]:
    """POST with ``stream: true``; (the chunks, seconds to the first one)."""
    body = dict(body, stream=True)
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if first is None:
                    first = time.perf_counter() - t0
                chunks.append(json.loads(data))
    except urllib.error.HTTPError as exc:
        raise ProxyError(leg, exc.code, exc.read().decode(errors="replace")[:500]) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise ProxyError(leg, None, str(exc)) from None
    if first is None:
        raise ProxyError(leg, 200, "the stream ended before the first token")
    return chunks, first


def disaggregated(prefill_url: str, decode_url: str, body: dict, *, timeout: float = 300.0,
                  prefill_extra: dict | None = None,
                  before_decode: Callable[[dict | None], dict | None] | None = None) -> Disaggregated:
    """Run one completion through P then D.  ``prefill_extra``: more keys
    for P's ``kv_transfer_params``; ``before_decode`` may delay or edit D's
    (the job's late-forward fault and KV dump tags); None: hand them on
    unchanged."""
    p_body = dict(body, max_tokens=1, stream=False,
                  kv_transfer_params={"do_remote_decode": True, **(prefill_extra or {})})
    p_body.pop("stream_options", None)
    t0 = time.perf_counter()
    p_resp = post_json(f"{prefill_url}/v1/completions", p_body, timeout=timeout, leg="prefill")
    p_seconds = time.perf_counter() - t0
    params = p_resp.get("kv_transfer_params")
    if before_decode is not None:
        params = before_decode(params)
    d_body = dict(body, kv_transfer_params=params)
    t1 = time.perf_counter()
    chunks, ttft = stream_completion(f"{decode_url}/v1/completions", d_body, timeout=timeout, leg="decode")
    d_seconds = time.perf_counter() - t1
    tokens: list[int] = []
    for c in chunks:
        for choice in c.get("choices", ()):
            tokens.extend(choice.get("token_ids") or ())
    return Disaggregated(prefill=p_resp, kv_transfer_params=params, text_tokens=tuple(tokens),
                         decode=chunks[-1], p_seconds=p_seconds, d_ttft_seconds=ttft, d_seconds=d_seconds)


# ---------------------------------------------------------------- the HTTP server
def make_handler(prefill_url: str, decode_url: str, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/v1/completions":
                return self._answer(404, {"error": f"{self.path}: kvplane proxy serves /v1/completions"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            except (ValueError, json.JSONDecodeError) as exc:
                return self._answer(400, {"error": f"bad JSON: {exc}"})
            if not isinstance(body, dict) or body.get("stream"):
                return self._answer(400, {"error": "a JSON object without stream: true (the proxy does not stream)"})
            try:
                result = disaggregated(prefill_url, decode_url, body, timeout=timeout)
            except ProxyError as exc:
                return self._answer(502, {"error": str(exc)})
            out = dict(result.decode)
            out["choices"] = [{"index": 0, "token_ids": list(result.text_tokens), "finish_reason":
                               (result.decode.get("choices") or [{}])[-1].get("finish_reason")}]
            self._answer(200, out)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":
                return self._answer(200, {"status": "ok"})
            self._answer(404, {"error": "not found"})

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

    return Handler


def serve(prefill_url: str, decode_url: str, *, host: str = "127.0.0.1", port: int = 8000,
          timeout: float = 300.0) -> ThreadingHTTPServer:
    """A started server (its thread is a daemon); ``shutdown()`` stops it."""
    server = ThreadingHTTPServer((host, port), make_handler(prefill_url.rstrip("/"), decode_url.rstrip("/"), timeout))
    threading.Thread(target=server.serve_forever, daemon=True, name="kvplane-proxy").start()
    return server


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, metavar="URL", help="P's vLLM server, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, metavar="URL", help="D's vLLM server, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per leg")


def cmd_proxy(args: argparse.Namespace) -> int:
    server = serve(args.prefill, args.decode, host=args.host, port=args.port, timeout=args.timeout)
    print(f"kvplane proxy on http://{args.host}:{server.server_address[1]}/v1/completions: "
          f"P {args.prefill}, D {args.decode} (Ctrl-C stops)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0
