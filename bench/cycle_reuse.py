"""CycleGRPO's nested rollout against the same completions generated independently (issue "CycleGRPO", reuse goal).

    python bench/cycle_reuse.py --model checkpoints/toy-qwen2.5-vl-cycle-video --engine fast [--device cuda --dtype bf16]
        [--samples 4 --n 6 --k 6 --tokens 32 --repeats 3] [--out experiments/results/cycle_reuse_<device>.json]
    python bench/cycle_reuse.py --model /tmp/qwen3vl-4b --build qwen3vl-4b --engine hf_shared --device cuda \
        --dtype bf16 ...   # Qwen3-VL-4B from its published dimensions, random weights (built there, not downloaded)
    python bench/cycle_reuse.py ... --clips [--clip-size 224 --clip-frames 16] --n 4 --k 4 \
        --caption-template video_caption --grounding-template temporal_grounding   # toy clips, interval space

A component profiler of the rollout engines (not a train.py figure): the two generate calls of one CycleGRPO step,
on B toy scenes, as `CycleGRPO.rollout` makes them, against the same N + N x K completions as independent requests.

* nested: B caption requests of n = N rows each (one prefill per prompt for its N rows), then B x N grounding
  requests of n = K rows (one prefill per caption, shared by its K groundings); the fast engine's vision cache runs
  each sample's image through the vision tower once for all of them (``engines/fast.py``, ``VisionCache``);
* independent: B x N caption requests and B x N x K grounding requests of one row each, each with its own copy of the
  image (every completion encodes its image and prefills its prompt).

Every completion is exactly ``--tokens`` long (min = max new tokens), so both sides decode the same number of
tokens; the grounding prompts hold the nested side's captions, coordinates stripped, as in training. Reported: the
median seconds of each side over ``--repeats``, their ratio, and the image encodings / prompt prefills each side ran.
The `hf` engine (transformers' generate) expands a prompt's rows before the prefill, so it shares nothing: its ratio
is the yardstick of "no reuse". `hf_shared` (transformers' generate after one shared prefill per prompt, the vision
tower served from the same kind of cache) is the reuse path of the architectures the fast engine does not implement
(Qwen3-VL: `configs/cycle_4b.yaml`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _clips(n: int, size: int, frames: int):
    """``n`` toy clips with a target moment (the cycle's samples; interval space), from the val split, seed 3."""
    from datamodules.video import ToyClipDataset

    data, out, i = ToyClipDataset("val", 64 * n, seed=3, size=size, num_frames=frames), [], 0
    while len(out) < n:
        s = data[i]
        i += 1
        if s.intervals:
            out.append(s)
    return out


def _copy(visual):
    """An equal copy of an image or clip that shares nothing by identity (no engine cache can match it)."""
    from core.video import VideoClip

    if isinstance(visual, VideoClip):
        return VideoClip([f.copy() for f in visual.frames], visual.fps)
    return visual.copy()


def _samples(n: int):
    from datamodules.rec import Sample
    from datamodules.toy import generate_split

    return [
        Sample(r["id"], r["image"], r["meta"]["query"], [list(r["solution"])], meta=r["meta"])
        for r in generate_split("val", n, seed=3)
    ]


def run(args) -> dict:
    from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
    from lightning_modules.methods.base import MethodContext
    from lightning_modules.methods.cycle_grpo import CycleGRPO, caption_text
    from lightning_modules.models.loading import load_policy

    device = torch.device(args.device)
    if args.build and not (Path(args.model) / "config.json").exists():
        from e2e_gpu import build_qwen  # bench/ is on the path when this file runs as a script

        build_qwen(Path(args.model), args.build, args.device, vocab_size=4096)
    model, processor = load_policy(args.model, dtype=args.dtype)
    model.to(device).eval()
    if args.engine == "fast":
        from lightning_modules.engines.packing import enable_fast_vision_attention

        enable_fast_vision_attention(model)
    engine = build_rollout_engine(args.engine)
    method = CycleGRPO(
        n_captions=args.n, k_groundings=args.k,
        caption_template=args.caption_template, region_space="interval" if args.clips else "box",
    ).bind(MethodContext(prompt_template=args.grounding_template))  # fmt: skip
    samples = _clips(args.samples, args.clip_size, args.clip_frames) if args.clips else _samples(args.samples)
    sampling = Sampling(max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=1.0)
    cap_prompts = [method.regions.caption_prompt(processor, s) for s in samples]
    torch.manual_seed(0)
    first = engine.generate(
        model, processor, [RolloutRequest(p, s.image, args.n, i) for i, (p, s) in enumerate(zip(cap_prompts, samples))],
        sampling,
    )  # fmt: skip
    captions = [caption_text(t) for t in first.texts]  # B x N, sample-major
    ground_prompts = [method.regions.grounding_prompt(processor, c, args.grounding_template) for c in captions]
    ground_images = [samples[i // args.n].image for i in range(len(captions))]

    def clear():
        if hasattr(engine, "vision"):  # the fast engine's vision cache: every repetition starts cold
            engine.vision.clear()

    # independent: every completion its own request with its own copy of the image (nothing shared by identity)
    cap_indep = [(p, _copy(s.image)) for p, s in zip(cap_prompts, samples) for _ in range(args.n)]
    ground_indep = [(p, _copy(im)) for p, im in zip(ground_prompts, ground_images) for _ in range(args.k)]

    def nested():
        clear()
        engine.generate(
            model, processor, [RolloutRequest(p, s.image, args.n, i) for i, (p, s) in enumerate(zip(cap_prompts, samples))],
            sampling,
        )  # fmt: skip
        engine.generate(
            model, processor,
            [RolloutRequest(p, im, args.k, i) for i, (p, im) in enumerate(zip(ground_prompts, ground_images))], sampling,
        )  # fmt: skip

    def independent():
        clear()
        engine.generate(
            model, processor, [RolloutRequest(p, im, 1, i) for i, (p, im) in enumerate(cap_indep)], sampling
        )
        engine.generate(
            model, processor, [RolloutRequest(p, im, 1, i) for i, (p, im) in enumerate(ground_indep)], sampling
        )

    def counts(fn) -> tuple[int | None, int | None]:
        """Images the engine ran through its vision tower and prompts it prefilled in one call of ``fn`` (where the
        engine counts them: ``fast`` and ``hf_shared`` keep a vision cache, ``hf_shared`` counts its prefills)."""
        vision, prefilled = getattr(engine, "vision", None), getattr(engine, "prefilled", None)
        before = (vision.encoded if vision else 0, prefilled or 0)
        with torch.no_grad():
            fn()
        return (
            vision.encoded - before[0] if vision else None,
            engine.prefilled - before[1] if prefilled is not None else None,
        )

    def once(fn) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    with torch.no_grad():
        nested()  # warm-up (kernels, allocator)
        independent()
    # interleaved, the order alternating per repeat: a drift of the machine (clocks, other processes) over the run
    # falls on both sides instead of on whichever ran second
    t_nested, t_indep = [], []
    for r in range(args.repeats):
        for side in ("n", "i") if r % 2 == 0 else ("i", "n"):
            (t_nested if side == "n" else t_indep).append(once(nested if side == "n" else independent))
    (enc_nested, pre_nested), (enc_indep, pre_indep) = counts(nested), counts(independent)
    B, N, K = args.samples, args.n, args.k
    shares = args.engine in ("fast", "hf_shared")
    if pre_nested is not None:  # counted, not derived
        assert pre_nested == B + B * N and pre_indep == B * (N + N * K), (pre_nested, pre_indep)
    result = {
        "what": "CycleGRPO nested rollout vs the same N + N x K completions as independent requests (component "
        "profiler of the rollout engine, not a train.py figure)",
        "model": args.model,
        "architecture": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "engine": args.engine,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "dtype": args.dtype,
        "samples": B,
        "visual": f"toy clips, {args.clip_frames} frames of {args.clip_size} px at 2 fps"
        if args.clips
        else "toy scenes",
        "n_captions": N,
        "k_groundings": K,
        "tokens_per_completion": args.tokens,
        "completions_per_step": B * (N + N * K),
        "nested_s": t_nested,
        "independent_s": t_indep,
        "nested_median_s": statistics.median(t_nested),
        "independent_median_s": statistics.median(t_indep),
        "speedup_independent_over_nested": statistics.median(t_indep) / statistics.median(t_nested),
        "prefills": {"nested": B + B * N if shares else B * (N + N * K), "independent": B * (N + N * K)},
        "image_encodings": {  # counted by the engine's vision cache (fast, hf_shared); the hf engine encodes every row
            "nested": enc_nested if enc_nested is not None else B * (N + N * K),
            "independent": enc_indep if enc_indep is not None else B * (N + N * K),
        },
        "date": time.strftime("%Y-%m-%d"),
    }
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default="checkpoints/toy-qwen2.5-vl-cycle-video")
    ap.add_argument("--engine", default="fast", choices=["fast", "hf", "hf_shared"])
    ap.add_argument(
        "--build", default=None, help="build --model first if absent: an arch of bench/e2e_gpu.py (qwen3vl-4b)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caption-template", default="toy_caption")
    ap.add_argument("--grounding-template", default="toy")
    ap.add_argument("--clips", action="store_true", help="toy video clips (interval space) instead of toy scenes")
    ap.add_argument("--clip-size", type=int, default=224)
    ap.add_argument("--clip-frames", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
