"""Serve a local checkpoint as an OpenAI-compatible judge (``lightning_modules/judge_server.py``).

    python -m cli.judge_server --model checkpoints/toy-qwen2.5-vl --port 8000
    # then, in a config: judge: {base_url: http://127.0.0.1:8000/v1, model: judge}

For the tests and toy runs only: real judges are served by vLLM (``vllm serve MODEL --served-model-name judge``),
which speaks the same API. A missing checkpoint exits 2 with the path.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


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

    from cli.errors import fail
    from lightning_modules.judge_server import build_app, load_generator

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
