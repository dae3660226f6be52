"""Throughput of the data server's painters. Prints figures; never asserts on time.

CPU (the embedded default): jobs/s of the procedural painter through a real server (``python -m synth.server`` on
loopback, spawned by ``synth.client.LocalServer``), submitted as fast as the client can:

    python bench/synth_throughput.py --jobs 200 --workers 1 [--size 224x224] [--extend 0.25] [--out experiments/results/x.json]

GPU (``--sdxl``): images/s of the full-size SDXL + ControlNet inpaint architecture with random weights (UNet 2.57B,
ControlNet 1.25B, both CLIP text encoders; built from the config dicts in ``synth/random_sdxl.py``, tokenizer written
offline), through ``synth.painters.DiffusersOutpainter.paint`` exactly as the worker calls it, at 640 x 480, for
8 and 25 steps, batch 1 and 4, bf16. Needs only torch, diffusers, transformers, numpy and pillow; no network:

    python bench/synth_throughput.py --sdxl [--pipeline union_inpaint|controlnet_inpaint] [--steps 8 25]
        [--batch 1 4] [--iters 3] [--compile] [--out experiments/results/synth_sdxl_h200.json]

``--sdxl --tiny --device cpu`` runs the same code path with the tiny configs (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _write(out: str | None, record: dict) -> None:
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **record,
    }
    text = json.dumps(record, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
        print(f"wrote {out}")


def _scene(path: Path, w: int, h: int, i: int) -> list[list[float]]:
    rng = np.random.default_rng(i)
    im = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(0, 256, 3)))
    bw, bh = w // 4, h // 4
    x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
    ImageDraw.Draw(im).ellipse([x, y, x + bw - 1, y + bh - 1], fill=(220, 40, 40))
    im.save(path)
    return [[x, y, x + bw, y + bh]]


# --- CPU: procedural painter through the real server -------------------------------------------------------------


def bench_procedural(args) -> None:
    from synth.api import ImageRef, JobRequest
    from synth.client import LocalServer

    w, h = (int(v) for v in args.size.split("x"))
    descriptions = [
        "a striped blue and white background with many small green triangles",
        "a checkered yellow background with few large purple stars",
        "a dotted cyan background with some small red circles",
        "a noisy gray background with no distractors",
    ]
    with tempfile.TemporaryDirectory(prefix="synth-bench-") as tmp:
        root = Path(tmp) / "images"
        root.mkdir()
        n_images = min(args.jobs, 32)
        scenes = [(root / f"{i}.png", _scene(root / f"{i}.png", w, h, i)) for i in range(n_images)]
        overrides = {"devices": ["cpu"] * args.workers, "batch_size": 1, "max_queued": args.jobs + 10}
        t_start = time.perf_counter()
        with LocalServer(roots=[root], output_dir=Path(tmp) / "out", overrides=overrides) as server:
            startup_s = time.perf_counter() - t_start
            with server.client(timeout=60) as client:
                reqs = [
                    JobRequest(
                        job_id=f"bench-{i}",
                        sample_id=f"s{i % n_images}",
                        image=ImageRef(path=str(scenes[i % n_images][0])),
                        boxes=scenes[i % n_images][1],
                        description=descriptions[i % 4],
                        seed=i,
                        canvas={"extend": args.extend},
                    )
                    for i in range(args.jobs)
                ]
                # warm-up (first job pays the grammar's lazy imports in each worker)
                client.submit(reqs[0].model_copy(update={"job_id": "warmup"}))
                client.wait(["warmup"], timeout=60)
                t0 = time.perf_counter()
                for r in reqs:
                    client.submit(r)
                submit_s = time.perf_counter() - t0
                done = client.wait([r.job_id for r in reqs], timeout=600, poll_interval=0.02)
                wall = time.perf_counter() - t0
    ok = sum(s.state == "done" for s in done.values())
    run_s = [s.timings.run_s for s in done.values() if s.timings.run_s is not None]
    paint_s = [s.timings.paint_s for s in done.values() if s.timings.paint_s is not None]
    record = {
        "mode": "procedural",
        "jobs": args.jobs,
        "ok": ok,
        "workers": args.workers,
        "image_size": [w, h],
        "extend": args.extend,
        "jobs_per_s": args.jobs / wall,
        "wall_s": wall,
        "submit_s": submit_s,
        "server_startup_s": startup_s,
        "median_run_s": statistics.median(run_s),
        "median_paint_s": statistics.median(paint_s),
    }
    print(
        f"procedural painter, {args.workers} worker(s), {w}x{h} (+{args.extend:.0%} canvas), {args.jobs} jobs: "
        f"{record['jobs_per_s']:.1f} jobs/s ({ok} ok; worker time per job {1e3 * record['median_run_s']:.1f} ms, "
        f"of which painting {1e3 * record['median_paint_s']:.1f} ms; submitting took {submit_s:.2f} s; "
        f"server start {startup_s:.1f} s)"
    )
    _write(args.out, record)


# --- GPU: full-size SDXL ControlNet architecture -----------------------------------------------------------------


def bench_sdxl(args) -> None:
    import torch

    from synth.compose import CanvasGeometry, boxes_mask, mask_to_canvas, place_image
    from synth.painters import DiffusersOutpainter, PaintJob
    from synth.random_sdxl import build_random_sdxl_components, count_parameters

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    size = "tiny" if args.tiny else "full"
    t0 = time.perf_counter()
    comps = build_random_sdxl_components(size, union=args.pipeline == "union_inpaint", device=device, dtype=dtype)
    params = count_parameters(comps)
    print(
        f"built {size} SDXL components on {device} in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{k} {v / 1e9:.2f}B" for k, v in params.items())
    )
    w, h = (int(v) for v in args.size.split("x"))
    painter = DiffusersOutpainter.from_components(
        comps,
        pipeline=args.pipeline,
        device=device,
        dtype=args.dtype,
        resolution=[w, h],
        multiple_of=8,
        guidance_scale=args.guidance,
        max_batch=max(args.batch),
        compile=args.compile,
    )
    tmp = Path(tempfile.mkdtemp(prefix="synth-bench-sdxl-"))
    atexit.register(shutil.rmtree, tmp, True)
    jobs = []
    for i in range(max(args.batch)):
        boxes = _scene(tmp / f"{i}.png", w, h, i)
        im = Image.open(tmp / f"{i}.png")
        g = CanvasGeometry.from_params(w, h)
        keep = mask_to_canvas(boxes_mask(boxes, w, h), g)
        known = np.ones((h, w), bool)
        jobs.append(PaintJob(f"j{i}", place_image(im, g), keep, known, "a striped blue background with few cats", i))
    results = []
    for steps in args.steps:
        painter.steps = steps
        for batch in args.batch:
            batch_jobs = jobs[:batch]
            for _ in range(args.warmup):
                painter.paint(batch_jobs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.iters):
                t = time.perf_counter()
                painter.paint(batch_jobs)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
            r = {
                "steps": steps,
                "batch": batch,
                "s_per_call": med,
                "images_per_s": batch / med,
                "peak_gib": peak,
                "times": times,
            }
            results.append(r)
            peak_txt = f", peak {peak:.1f} GiB" if peak is not None else ""
            print(
                f"{args.pipeline} {w}x{h} {args.dtype} {steps:>2} steps batch {batch}: {med:.2f} s per call, "
                f"{batch / med:.2f} images/s{peak_txt}",
                flush=True,
            )
    _write(
        args.out,
        {
            "mode": "sdxl",
            "size": size,
            "pipeline": args.pipeline,
            "resolution": [w, h],
            "dtype": args.dtype,
            "guidance_scale": args.guidance,
            "compile": args.compile,
            "parameters": params,
            "results": results,
        },
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sdxl", action="store_true", help="GPU mode: full-size SDXL ControlNet, random weights")
    p.add_argument("--out", help="write a JSON record here (e.g. experiments/results/synth_procedural_cpu.json)")
    p.add_argument("--size", help="WxH of the images (default 224x224 for procedural, 640x480 for --sdxl)")
    g = p.add_argument_group("procedural (CPU)")
    g.add_argument("--jobs", type=int, default=200)
    g.add_argument("--workers", type=int, default=1, help="CPU worker processes")
    g.add_argument("--extend", type=float, default=0.0, help="canvas extension (outpainting) per job")
    g = p.add_argument_group("--sdxl (GPU)")
    g.add_argument("--pipeline", default="union_inpaint", choices=["union_inpaint", "controlnet_inpaint"])
    g.add_argument("--steps", type=int, nargs="+", default=[8, 25])
    g.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    g.add_argument("--iters", type=int, default=3)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    g.add_argument("--guidance", type=float, default=5.0)
    g.add_argument("--compile", action="store_true", help="torch.compile the UNet and ControlNet")
    g.add_argument("--device", help="default: cuda if available")
    g.add_argument("--tiny", action="store_true", help="tiny configs instead of full size (smoke test on CPU)")
    args = p.parse_args(argv)
    if args.size is None:
        args.size = "640x480" if args.sdxl else "224x224"
    if args.sdxl:
        bench_sdxl(args)
    else:
        bench_procedural(args)


if __name__ == "__main__":
    main()
