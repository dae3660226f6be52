"""A local OpenAI-compatible judge server for tests: FastAPI + uvicorn in a daemon thread on a free port.

Tests that exercise :class:`lightning_modules.judge.JudgeClient` (the judge's own tests, the caption reward, DLC-Bench,
DOVE) talk to a real HTTP server rather than a mock, so timeouts, retries and concurrency are the real ones. Routes,
each an OpenAI ``/chat/completions`` under its own base URL (give ``<url><prefix>/v1`` to ``JudgeConfig.base_url``):

- ``/v1``: the fixed reply ``reply`` (default ``"Score: 7"``) after ``fast_s`` seconds;
- ``/slow/v1``: ``slow_reply`` after ``slow_s`` seconds (longer than a test's client timeout);
- ``/scripted/v1``: ``state.script(prompt)``, the reply as a function of the last user message (set or swap it on
  the state at any time);
- ``/chatty/v1``: a reply without a number; ``/broken/v1``: HTTP 503 every time;
- ``GET /v1/models``: one model, ``"toy-judge"``.

Every request body, its Authorization header and the peak number in flight are recorded on :class:`JudgeServerState`.

Usage::

    from tests.judge_server import running_judge_server

    with running_judge_server(script=lambda prompt: "yes") as judge:
        client = JudgeClient(JudgeConfig(base_url=judge.url + "/scripted/v1", trust_env=False))

``running_toy_judge()`` serves the product's judge server over the toy checkpoint instead (real model replies);
or import the module-scoped fixture: ``from tests.judge_server import judge_server  # noqa: F401`` and ask for
``judge_server`` (a :class:`RunningJudge`).
"""

# no ``from __future__ import annotations``: FastAPI resolves the routes' ``fastapi.Request`` annotations at runtime,
# and fastapi is imported inside judge_app so that importing this module never needs it
import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = [
    "JudgeServerState",
    "RunningJudge",
    "free_port",
    "judge_app",
    "judge_server",
    "last_prompt",
    "running_judge_server",
    "running_toy_judge",
    "toy_judge_for_config",
    "serve_in_thread",
]


@dataclass
class JudgeServerState:
    """What the server saw, and the scripted route's reply function (swap ``script`` between tests)."""

    script: Callable[[str], str] = lambda prompt: "Score: 5"
    requests: list[dict] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset_counts(self) -> None:
        with self.lock:
            self.max_in_flight = 0


@dataclass
class RunningJudge:
    """A started server: ``url`` is ``http://127.0.0.1:<port>`` (append a route prefix and ``/v1``)."""

    url: str
    state: JudgeServerState


def last_prompt(body: dict) -> str:
    """The text of the last message of a chat-completions body (a string, or the text parts of a content list)."""
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def free_port() -> int:
    """A port that was free a moment ago (bound then closed, so connecting to it is refused until reused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def judge_app(
    state: JudgeServerState,
    reply: str = "Score: 7",
    fast_s: float = 0.05,
    slow_reply: str = "Score: 9",
    slow_s: float = 1.5,
):
    """The FastAPI app with the routes of the module docstring."""
    import fastapi

    app = fastapi.FastAPI()

    async def _serve(request: fastapi.Request, delay: float, make: Callable[[dict], str]):
        body = await request.json()
        with state.lock:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            state.requests.append(body)
            state.auth.append(request.headers.get("authorization"))
        try:
            await asyncio.sleep(delay)
            content = make(body)
        finally:
            with state.lock:
                state.in_flight -= 1
        return {
            "object": "chat.completion",
            "model": body.get("model", "toy-judge"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        }

    @app.post("/v1/chat/completions")
    async def fixed(request: fastapi.Request):
        return await _serve(request, fast_s, lambda body: reply)

    @app.post("/slow/v1/chat/completions")
    async def slow(request: fastapi.Request):
        return await _serve(request, slow_s, lambda body: slow_reply)

    @app.post("/scripted/v1/chat/completions")
    async def scripted(request: fastapi.Request):
        return await _serve(request, 0.0, lambda body: state.script(last_prompt(body)))

    @app.post("/chatty/v1/chat/completions")
    async def chatty(request: fastapi.Request):
        return await _serve(request, 0.0, lambda body: "I cannot grade this.")

    @app.post("/broken/v1/chat/completions")
    async def broken():
        raise fastapi.HTTPException(status_code=503, detail="overloaded")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "toy-judge", "object": "model", "owned_by": "tests"}]}

    return app


@contextmanager
def serve_in_thread(app, start_timeout_s: float = 10.0) -> Iterator[str]:
    """Run an ASGI ``app`` with uvicorn in a daemon thread on a free port; yields ``http://127.0.0.1:<port>``."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the local test server on port {port} did not start within {start_timeout_s:g} s")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


@contextmanager
def running_judge_server(
    reply: str = "Score: 7",
    script: Callable[[str], str] | None = None,
    fast_s: float = 0.05,
    slow_s: float = 1.5,
) -> Iterator[RunningJudge]:
    """Start the judge app (see the module docstring) and yield its URL and state; stops it on exit."""
    state = JudgeServerState() if script is None else JudgeServerState(script=script)
    with serve_in_thread(judge_app(state, reply=reply, fast_s=fast_s, slow_s=slow_s)) as url:
        yield RunningJudge(url, state)


TOY_CHECKPOINT = str(Path(__file__).resolve().parents[1] / "checkpoints" / "toy-qwen2.5-vl")


@contextmanager
def running_toy_judge(path: str = TOY_CHECKPOINT, name: str = "judge", max_tokens: int = 16) -> Iterator[str]:
    """The product's judge server (``cli/judge_server.py``, what ``python -m cli.judge_server`` runs)
    over the toy checkpoint, in a thread; yields its base URL ``http://127.0.0.1:<port>/v1``. Its replies are whatever
    the toy model says."""
    from cli.judge_server import build_app, load_generator

    gen = load_generator(path, name, dtype="fp32", device="cpu", max_tokens=max_tokens)
    with serve_in_thread(build_app(gen)) as url:
        yield url + "/v1"


@contextmanager
def toy_judge_for_config(cfg: dict, path) -> Iterator[str | None]:
    """For a training config (a composed dict) whose method has a ``judge``: serve the toy judge
    (`running_toy_judge`), point ``judge.base_url`` at it (proxies off) and rewrite the config file ``path``; yields
    the URL, or None (and does nothing) for a config without a judge. tests/cli/test_config_runs.py runs every config
    inside it, so configs/overlays/cycle_judge.yaml trains against a real server."""
    import yaml

    method = cfg["model"]["init_args"].get("method")
    judge = (method.get("init_args") or {}).get("judge") if isinstance(method, dict) else None
    if not judge:
        yield None
        return
    with running_toy_judge(name=judge.get("model", "judge"), max_tokens=8) as url:
        judge.update(base_url=url, trust_env=False)
        Path(path).write_text(yaml.safe_dump(cfg, sort_keys=False))
        yield url


@pytest.fixture(scope="module")
def judge_server() -> Iterator[RunningJudge]:
    """Module-scoped judge server with the default routes (fixed reply "Score: 7", slow route 1.5 s)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with running_judge_server() as judge:
        yield judge
