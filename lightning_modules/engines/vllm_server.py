"""A vLLM rollout server for ``--model.engines.rollout_engine vllm`` in ``server`` mode (docs/vllm.md).

    python -m lightning_modules.engines.vllm_server --model DIR --port 8000 [--host 0.0.0.0] [--dtype float32]

One ``vllm.LLM`` (`engines.vllm_backend.VLLMGenerator`) behind a small FastAPI app, the client being
`engines.vllm_backend.VLLMServerClient`:

- ``GET /health``: ``{status, model, dtype, vocab_size, weights, architecture, clips}`` (``weights``: the directory
  last reloaded, or the model's; ``clips``: whether it samples video clips, Qwen2.5-VL only);
- ``POST /generate``: a `SampleRequest` (prompts, base64 PNG images or clips of PNG frames + fps, sampling) ->
  `SampleResponse` (prompt ids, completion ids, their log-probs);
- ``POST /reload_weights``: ``{path}``: a directory of ``*.safetensors`` (the trainer writes one after every
  optimizer step on storage both machines see); the weights are replaced in place and the encoder and prefix caches
  reset, so no request after it sees the old weights.

Requests are served one at a time (a lock around the engine): a generate and a reload never interleave.
Written over vLLM's Python API rather than its OpenAI-compatible server, which returns text, not the token ids and
log-probs the trainer needs, and has no weight reload outside its development mode.
"""

from __future__ import annotations

import argparse
import threading
import time

from lightning_modules.engines.vllm_backend import (
    ReloadRequest,
    SampleRequest,
    SampleResponse,
    UnsupportedClipError,
    VLLMGenerator,
)

__all__ = ["build_app", "main"]


def build_app(gen: VLLMGenerator):
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="syn-grpo vLLM rollout server")
    lock = threading.Lock()

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "model": gen.model,
            "dtype": gen.dtype,
            "vocab_size": gen.vocab_size,
            "weights": gen.weights,
            "architecture": gen.architecture,
            "clips": gen.takes_clips,
        }

    @app.post("/generate", response_model=SampleResponse)
    def generate(req: SampleRequest) -> SampleResponse:
        if len(req.images) + len(req.videos) != len(req.prompts) or (req.images and req.videos):
            raise HTTPException(
                422,
                f"one image or one clip per prompt, one kind per request: {len(req.images)} images and "
                f"{len(req.videos)} clips for {len(req.prompts)} prompts",
            )
        with lock:
            try:
                return gen.generate(req)
            except UnsupportedClipError as err:  # clips on a model whose positions vLLM would get wrong
                raise HTTPException(422, str(err)) from err

    @app.post("/reload_weights")
    def reload_weights(req: ReloadRequest) -> dict:
        with lock:
            try:
                seconds = gen.load_weights(path=req.path)
            except FileNotFoundError as err:
                raise HTTPException(404, str(err)) from err
        return {"weights": gen.weights, "seconds": seconds}

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m lightning_modules.engines.vllm_server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="model directory (save_pretrained) vLLM starts from")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve trainer nodes")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--dtype",
        default="auto",
        help="the policy's dtype (auto: the checkpoint's config; vLLM's own auto would run fp32 in 16 bits)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU: fraction of the device for vLLM")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache size (CPU default 512 MiB)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false", help="allow CUDA graphs")
    args = p.parse_args(argv)

    import uvicorn

    t0 = time.perf_counter()
    gen = VLLMGenerator(
        args.model,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )
    print(f"[vllm_server] {args.model} loaded in {time.perf_counter() - t0:.1f} s; serving on {args.host}:{args.port}")
    try:
        uvicorn.run(build_app(gen), host=args.host, port=args.port, log_level="warning")
    finally:
        gen.close()


if __name__ == "__main__":
    main()
