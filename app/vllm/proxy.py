"""A proxy speaking vLLM's disaggregated-serving protocol.

Each completion goes to P first with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; P's response carries
the ``kv_transfer_params`` that tell D where the prompt's KV is; the same
request then goes to D with them, and D's answer is the client's.  This is
the protocol of vLLM's own toy proxy, so kvplane's connector and vLLM's
NixlConnector are driven the same way.

``disaggregated`` is the protocol as a blocking client (the main job calls
it directly, timing each leg).  ``make_app`` is the same protocol as a
server (``kvplane proxy``): an ASGI app (Starlette) served by uvicorn,
relaying with one ``httpx.AsyncClient``: ``/v1/completions`` and
``/v1/chat/completions``, streamed or not, over several P and D engines
(round robin, each leg its own turn).  An upstream that cannot be reached
or answers with an error gets the client a 502 with a JSON body naming the
leg and the engine; a request that is not a JSON object, a 400.  Those
libraries come with vLLM (the ``proxy`` extra names them) and are imported
only when the server is built.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import uuid
import urllib.error
import urllib.request
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


def post_json(url: str, body: dict, *, timeout: float, leg: str, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ProxyError(leg, exc.code, exc.read().decode(errors="replace")[:500]) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise ProxyError(leg, None, str(exc)) from None


def stream_completion(url: str, body: dict, *, timeout: float, leg: str,
                      headers: dict[str, str] | None = None) -> tuple[list[dict], float]:
    """POST with ``stream: true``; (the chunks, seconds to the first one)."""
    body = dict(body, stream=True)
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
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
    unchanged.  Both legs carry one ``X-Request-Id`` (as vLLM's toy proxy
    and ``make_app`` send): NixlPushConnector's P matches D's registration
    to its finished request by that id (kvplane's by the lease name)."""
    ids = {"X-Request-Id": str(uuid.uuid4())}
    p_body = dict(body, max_tokens=1, stream=False,
                  kv_transfer_params={"do_remote_decode": True, **(prefill_extra or {})})
    p_body.pop("stream_options", None)
    t0 = time.perf_counter()
    p_resp = post_json(f"{prefill_url}/v1/completions", p_body, timeout=timeout, leg="prefill", headers=ids)
    p_seconds = time.perf_counter() - t0
    params = p_resp.get("kv_transfer_params")
    if before_decode is not None:
        params = before_decode(params)
    d_body = dict(body, kv_transfer_params=params)
    t1 = time.perf_counter()
    chunks, ttft = stream_completion(f"{decode_url}/v1/completions", d_body, timeout=timeout, leg="decode",
                                     headers=ids)
    d_seconds = time.perf_counter() - t1
    tokens: list[int] = []
    for c in chunks:
        for choice in c.get("choices", ()):
            tokens.extend(choice.get("token_ids") or ())
    return Disaggregated(prefill=p_resp, kv_transfer_params=params, text_tokens=tuple(tokens),
                         decode=chunks[-1], p_seconds=p_seconds, d_ttft_seconds=ttft, d_seconds=d_seconds)


# ---------------------------------------------------------------- the HTTP server
# What the prefill leg must not carry (P computes the prompt and one token).
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens")
PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The request as P gets it: one token, no streaming, and a request to keep its KV for D."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def _error(status: int, message: str, **where: Any):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "bad_gateway" if status == 502 else "bad_request",
                                   "code": status, **where}}, status_code=status)


def make_app(prefill_urls: list[str], decode_urls: list[str], *, timeout: float = 300.0,
             transport: Any = None) -> Any:
    """The proxy as an ASGI app.  ``transport``: the httpx transport to the
    engines (tests hand in an ``httpx.ASGITransport``); None: the network."""
    import contextlib

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    prefills = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    clients: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any):
        clients["http"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout), transport=transport)
        try:
            yield
        finally:
            await clients.pop("http").aclose()

    def headers_for(request: Request, request_id: str) -> dict[str, str]:
        out = {"X-Request-Id": request_id}
        if "authorization" in request.headers:
            out["Authorization"] = request.headers["authorization"]
        return out

    async def upstream_failed(leg: str, url: str, resp: httpx.Response) -> Any:
        """An engine's error answer: a client error (4xx) goes back as it is;
        anything else is the proxy's 502."""
        text = (await resp.aread()).decode(errors="replace")[:2000]
        if 400 <= resp.status_code < 500:
            try:
                return JSONResponse(json.loads(text), status_code=resp.status_code)
            except ValueError:
                pass
        return _error(502, f"{leg} engine answered {resp.status_code}: {text or '(empty)'}", leg=leg, upstream=url)

    async def relay(request: Request) -> Any:
        path = request.url.path
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        client = clients["http"]
        request_id = str(uuid.uuid4())
        headers = headers_for(request, request_id)
        p_url, d_url = next(prefills), next(decodes)
        try:
            p_resp = await client.post(p_url + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill engine {p_url} unreachable: {type(exc).__name__}: {exc}", leg="prefill",
                          upstream=p_url)
        if p_resp.status_code != 200:
            return await upstream_failed("prefill", p_url, p_resp)
        try:
            params = p_resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            return _error(502, "prefill engine answered something that is not a JSON object", leg="prefill",
                          upstream=p_url)
        if not isinstance(params, dict) or not params:
            return _error(502, "prefill engine answered without kv_transfer_params (is it started with a KV "
                               "connector as a producer?)", leg="prefill", upstream=p_url)
        d_body = dict(body, kv_transfer_params=params)
        try:
            d_resp = await client.send(client.build_request("POST", d_url + path, json=d_body, headers=headers),
                                       stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"decode engine {d_url} unreachable: {type(exc).__name__}: {exc}", leg="decode",
                          upstream=d_url)
        if d_resp.status_code != 200:
            try:
                return await upstream_failed("decode", d_url, d_resp)
            finally:
                await d_resp.aclose()
        if not body.get("stream"):
            try:
                raw = await d_resp.aread()
            except httpx.HTTPError as exc:
                return _error(502, f"decode engine {d_url} broke off: {exc}", leg="decode", upstream=d_url)
            finally:
                await d_resp.aclose()
            try:
                return JSONResponse(json.loads(raw))
            except ValueError:
                return _error(502, "decode engine answered something that is not JSON", leg="decode", upstream=d_url)

        async def chunks():
            try:
                async for chunk in d_resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                # The status line is out: say it in the stream, as an engine would.
                err = {"error": {"message": f"decode engine {d_url} broke off: {exc}", "type": "bad_gateway",
                                 "code": 502}}
                yield f"data: {json.dumps(err)}\n\n".encode()
            finally:
                await d_resp.aclose()

        return StreamingResponse(chunks(), media_type=d_resp.headers.get("content-type", "text/event-stream"))

    async def health(_request: Request) -> Any:
        return JSONResponse({"status": "ok", "prefill": list(prefill_urls), "decode": list(decode_urls)})

    routes = [Route(path, relay, methods=["POST"]) for path in PATHS] + [Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan)


# ---------------------------------------------------------------- command line
def port(text: str) -> int:
    """``--port``: 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (1..65535)")
    return value


def engine_url(text: str) -> str:
    """``--prefill`` / ``--decode``: http(s)://host:port of a vLLM server."""
    from urllib.parse import urlsplit

    from kvplane.transport.wire import host_problem

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not an http(s)://host:port URL")
    problem = host_problem(parts.hostname)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}: {problem}")
    return text.rstrip("/")


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def add_proxy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, nargs="+", type=engine_url, metavar="URL",
                   help="P's vLLM server(s), e.g. http://127.0.0.1:8100 (several: round robin)")
    p.add_argument("--decode", required=True, nargs="+", type=engine_url, metavar="URL",
                   help="D's vLLM server(s), e.g. http://127.0.0.1:8200 (several: round robin)")
    p.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    p.add_argument("--port", type=port, default=8000, help="the port to serve on (1..65535)")
    p.add_argument("--timeout", type=positive, default=300.0, metavar="S", help="per leg")


def cmd_proxy(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        app = make_app(args.prefill, args.decode, timeout=args.timeout)
    except ImportError as exc:
        print(f"kvplane proxy: {exc.name} is missing: pip install 'kvplane[proxy]'", file=sys.stderr)
        return 2
    print(f"kvplane proxy on http://{args.host}:{args.port} ({', '.join(PATHS)}): P {' '.join(args.prefill)}, "
          f"D {' '.join(args.decode)} (Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
