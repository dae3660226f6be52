"""A small OpenAI-compatible chat-completions server over a local checkpoint: the judge for tests and toy runs.

    python -m cli.judge_server --model checkpoints/toy-qwen2.5-vl --port 8000
    # then, in a config: judge: {base_url: http://127.0.0.1:8000/v1, model: judge}

For the tests and toy runs only: the real judges (DLC-Bench's Llama-3.1-8B, the repository's caption judge) are served
by vLLM's OpenAI server (``vllm serve MODEL --served-model-name judge``); this one speaks the same subset of that API
so :class:`lightning_modules.judge.JudgeClient` talks to either unchanged:

- ``POST /v1/chat/completions``: ``{model, messages, max_tokens, temperature, n}`` -> ``{id, object, created, model,
  choices: [{index, message: {role, content}, finish_reason}], usage}``. Text only: a message's content is a string
  or a list of parts whose ``text`` parts are joined (an image part is refused with 400). Decoding is greedy whatever
  ``temperature`` asks (a judge's score must be reproducible); ``n`` must be 1; ``max_tokens`` is capped by
  ``--max-tokens``. A ``model`` other than the served name is a 404, as vLLM answers it.
- ``GET /v1/models``: the served name; ``GET /health``: ``{status, model, path}``.

The checkpoint is loaded with the project's loader (``models.loading.load_policy``: ``from_pretrained``, local files
only) and generates with ``model.generate`` under a lock, one request at a time (a model is not thread-safe; FastAPI
queues the others in its thread pool, and the client's own timeout bounds their wait). Special tokens other than EOS
are suppressed, as in rollouts, so a random toy model cannot emit an image placeholder into a text-only prompt.
What the toy model answers is noise: it serves the request / response contract, not judgements. A missing checkpoint
exits 2 with the path.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from cli.errors import fail
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import eos_token_ids, special_token_ids

__all__ = ["ChatMessage", "ChatRequest", "TextGenerator", "build_app", "load_generator", "main"]


class ChatMessage(BaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    n: int = 1


def message_text(message: ChatMessage) -> str:
    """The text of one message; raises ValueError for a non-text part (this server has no vision input)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type", "text") != "text":
            raise ValueError(f"content part of type {part.get('type')!r}: this judge server takes text only")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


class TextGenerator:
    """Greedy text-only chat generation with a loaded ``(model, processor)``; ``generate`` is serialised by a lock."""

    def __init__(self, model, processor, name: str, path: str, max_tokens: int = 256):
        self.model, self.processor, self.name, self.path, self.max_tokens = model, processor, name, path, max_tokens
        tok = processor.tokenizer
        self._eos = eos_token_ids(tok)
        self._suppress = special_token_ids(tok, keep=self._eos)
        self._lock = threading.Lock()

    def generate(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str, int, int]:
        """``(text, finish_reason, prompt_tokens, completion_tokens)`` of the greedy reply to ``messages``."""
        import torch

        tok = self.processor.tokenizer
        prompt = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        device = next(self.model.parameters()).device
        enc = tok([prompt], return_tensors="pt").to(device)
        budget = min(max_tokens, self.max_tokens)
        with self._lock, torch.inference_mode():
            out = self.model.generate(
                **enc,
                max_new_tokens=budget,
                do_sample=False,
                suppress_tokens=self._suppress,
                eos_token_id=self._eos,
                pad_token_id=tok.pad_token_id,
            )
        ids = out[0, enc["input_ids"].shape[1] :].tolist()
        ended = bool(ids) and ids[-1] in self._eos
        text = tok.decode(ids, skip_special_tokens=True)
        return text, "stop" if ended or len(ids) < budget else "length", enc["input_ids"].shape[1], len(ids)


def build_app(gen: TextGenerator):
    """The FastAPI app of the module docstring over ``gen``."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="syn-grpo toy judge (OpenAI-compatible)")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": gen.name, "path": gen.path}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": gen.name, "object": "model", "owned_by": "syn-grpo"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict:  # a sync route: FastAPI runs it in its thread pool, the lock serialises
        if req.model != gen.name:
            raise HTTPException(404, f"the model {req.model!r} does not exist; this server serves {gen.name!r}")
        if req.n != 1:
            raise HTTPException(400, f"n={req.n}: this judge server answers one choice per request")
        try:
            messages = [{"role": m.role, "content": message_text(m)} for m in req.messages]
        except ValueError as err:
            raise HTTPException(400, str(err)) from None
        text, finish, n_prompt, n_completion = gen.generate(messages, req.max_tokens or gen.max_tokens)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": gen.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_completion,
                "total_tokens": n_prompt + n_completion,
            },
        }

    return app


def load_generator(
    path: str, name: str = "judge", *, dtype: str = "auto", device: str | None = None, max_tokens: int = 256
) -> TextGenerator:
    """Load the checkpoint at ``path`` with the project's loader and wrap it (``device``: default cuda if any)."""
    import torch

    model, processor = load_policy(path, dtype=dtype)
    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    return TextGenerator(model, processor, name, path, max_tokens=max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.judge_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder (save_pretrained layout)")
    parser.add_argument("--served-model-name", default="judge", help="the name requests must give (judge.model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=256, help="cap on a request's max_tokens")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not (Path(args.model) / "config.json").is_file():
        fail(
            f"--model {args.model!r}: no config.json there; give a save_pretrained folder (e.g. "
            "checkpoints/toy-qwen2.5-vl, or a downloaded judge model)"
        )
    t0 = time.perf_counter()
    gen = load_generator(
        args.model, args.served_model_name, dtype=args.dtype, device=args.device, max_tokens=args.max_tokens
    )
    import uvicorn

    print(
        f"[judge_server] {args.model} loaded in {time.perf_counter() - t0:.1f} s; serving {args.served_model_name!r} "
        f"on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    uvicorn.run(build_app(gen), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
