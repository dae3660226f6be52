"""VQ-SAM2 mask decoding throughput, batched against one by one, and its share of a CycleGRPO step (issue 55 item 3).

    python bench/mask_decode.py --size tiny --device cpu --threads 1          # seconds on one CPU core
    python bench/mask_decode.py --size hiera-l --device cuda --images 4 --codes 12 [--out experiments/results/x.json]
    python bench/mask_decode.py --size tiny --device cpu --threads 1 --fit --quick      # + a train.py fit, toy, CPU
    python bench/mask_decode.py --size hiera-l --device cuda --fit --fit-steps 3 \
        --fit-config configs/cycle_4b.yaml configs/overlays/cycle_4b_parquet.yaml --fit-arg=--data.init_args...

A component benchmark of ``VQSam2MaskTokenizer`` (``lightning_modules/models/mask_tokenizer/vq_sam2.py``) with random
weights at a given size (``tiny``: the tests' 64-pixel SAM 2; ``hiera-l``: SAM 2.1 Hiera-L, the release's), on a given
device. ``--images`` random images of ``--image-size`` pixels, ``--codes`` code pairs on each (distinct, as after the
step's cache: repeated pairs are not decoded again):

* one by one: ``decode(codes, image)`` per pair, so the image encoder runs for every pair (the tokenizer before
  issue 55, and what a cache miss costs);
* batched: one ``decode_batch`` over all pairs (each image encoded once, up to ``--batch-size`` pairs per mask-decoder
  call), what a CycleGRPO step does (``MaskRegions.prefetch``).

Reported: decodes/s of each and their ratio. With ``--fit``, the same tokenizer is written in the release's layout
(``mask_tokenizer_256x2.pth`` beside a transformers ``sam2/``), named as the run's ``mask_tokenizer``, and
``train.py fit`` runs ``--fit-steps`` steps of ``--fit-config`` (default: the toy cycle with masks); the share of the
steps' wall time (the sum of ``train/time/*_s`` in ``metrics.jsonl``) spent in the tokenizer's decode (and encode)
calls is printed. ``--quick`` shrinks the toy run to seconds on a CPU (4 toy scenes, one per step, N = K = 2, 16 new
tokens, no validation). The toy checkpoints never learnt mask tokens, so their groundings seldom write a span and the
toy fit's decode share is a floor; a policy after the co-SFT cold start writes one per grounding.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = ("tiny", "hiera-l")
TOY_FIT = ["configs/cycle_tiny.yaml", "configs/overlays/cycle_tiny_mask.yaml"]


def sam2_config(size: str):
    """transformers' ``Sam2Config`` of ``size``: ``tiny`` (64-pixel input, a few blocks) or ``hiera-l``."""
    from lightning_modules.models.mask_tokenizer.vq_sam2 import hiera_large_config, tiny_config

    return hiera_large_config() if size == "hiera-l" else tiny_config()


def build_net(size: str, seed: int = 0):
    """A ``VQSam2Net`` of ``size`` with random weights (seeded; the codebooks initialised)."""
    from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2Net

    torch.manual_seed(seed)
    net = VQSam2Net(sam2_config(size))
    with torch.no_grad():
        net.quantizer.embed.normal_()
        net.quantizer.initted.fill_(True)
    return net


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(tok, images: list[np.ndarray], codes_per_image: int, seed: int = 0) -> dict:
    """Seconds and decodes/s of the one-by-one and the batched decode of ``codes_per_image`` distinct code pairs on
    each image, after one warm-up decode; whether both gave the same masks."""
    rng = np.random.default_rng(seed)
    codes, owners = [], []
    for im in images:
        picked = rng.choice(256 * 256, size=codes_per_image, replace=False)
        codes += [(int(p // 256), int(p % 256)) for p in picked]
        owners += [im] * codes_per_image
    tok.decode(codes[0], owners[0])  # warm-up (CUDA context, kernels, allocator)
    _sync(tok.device)
    t0 = time.perf_counter()
    single = [tok.decode(c, im) for c, im in zip(codes, owners)]
    t1 = time.perf_counter()
    batched = tok.decode_batch(codes, owners)
    t2 = time.perf_counter()
    n = len(codes)
    return {
        "decodes": n,
        "one_by_one_s": t1 - t0,
        "batched_s": t2 - t1,
        "one_by_one_per_s": n / (t1 - t0),
        "batched_per_s": n / (t2 - t1),
        "speedup": (t1 - t0) / (t2 - t1),
        "equal_masks": all(np.array_equal(a, b) for a, b in zip(single, batched)),
    }


def save_released(net, folder: Path) -> Path:
    """Write ``net`` in the release's layout: ``mask_tokenizer_256x2.pth`` beside a transformers ``sam2/`` (what
    ``load_mask_codec`` reads); returns ``folder``."""
    from lightning_modules.models.mask_tokenizer.vq_sam2 import released_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    torch.save(released_state_dict(net), folder / "mask_tokenizer_256x2.pth")
    net.sam.save_pretrained(folder / "sam2")
    return folder


def _train_seconds(metrics: Path) -> tuple[float, int]:
    """The sum of every ``train/time/*_s`` value in ``metrics.jsonl`` and the number of rows that had one."""
    total, steps = 0.0, 0

    def walk(obj) -> float:
        if isinstance(obj, dict):
            return sum(
                float(v)
                if isinstance(k, str) and k.startswith("train/time/") and isinstance(v, (int, float))
                else walk(v)
                for k, v in obj.items()
            )
        return 0.0

    for line in metrics.read_text().splitlines():
        s = walk(json.loads(line))
        if s > 0:
            total, steps = total + s, steps + 1
    return total, steps


def fit_share(net, args, root: Path) -> dict:
    """Run ``train.py fit`` with this tokenizer (module docstring); the share of the steps' time in its calls."""
    from cli.main import cli_main

    folder = save_released(net, root / "vq-sam2")
    run = root / "run"
    argv = ["fit"] + [x for c in args.fit_config for x in ("--config", str(REPO / c))]
    argv += [
        "--trainer.max_steps", str(args.fit_steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run),
        "--model.init_args.method.init_args.mask_tokenizer", str(folder),
    ]  # fmt: skip
    if args.fit_device:
        argv += ["--model.init_args.method.init_args.mask_device", args.fit_device]
    if args.quick:
        argv += [
            "--data.init_args.data_root", str(root / "toy"),
            "--data.init_args.toy", "{splits: {train: 4, val: 2, ood: 2}, seed: 0}",
            "--data.init_args.batch_size", "1",
            "--model.init_args.method.init_args.n_captions", "2",
            "--model.init_args.method.init_args.k_groundings", "2",
            "--model.init_args.sampling.max_new_tokens", "16",
            "--callbacks.gallery", "null",
            "--callbacks.completions", "null",
            "--callbacks.checkpoint", "null",
            "--callbacks.progress", "null",
        ]  # fmt: skip
    argv += ["--trainer.enable_progress_bar", "false", *args.fit_arg]
    saved, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI reads sys.argv too: only the flags built here
    try:
        cli = cli_main(argv)
    finally:
        sys.argv = saved
    tok = cli.model.method.masks.codec
    step_s, steps = _train_seconds(run / "metrics.jsonl")
    return {
        "fit_config": args.fit_config,
        "steps": steps,
        "step_s": step_s,
        "decode_s": tok.seconds["decode"],
        "encode_s": tok.seconds["encode"],
        "decodes": tok.n_decoded,
        "image_encodings_for_decode": tok.n_images,
        "decode_share": tok.seconds["decode"] / step_s if step_s else float("nan"),
        "tokenizer_share": (tok.seconds["decode"] + tok.seconds["encode"]) / step_s if step_s else float("nan"),
        "tokenizer_device": str(tok.device),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--codes", type=int, default=8, help="distinct code pairs per image")
    p.add_argument("--image-size", type=int, nargs=2, default=(480, 640), metavar=("H", "W"))
    p.add_argument("--batch-size", type=int, default=32, help="code pairs per mask-decoder call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit", action="store_true", help="also run train.py fit and report the decode share")
    p.add_argument("--fit-config", nargs="+", default=TOY_FIT)
    p.add_argument("--fit-steps", type=int, default=2)
    p.add_argument("--fit-device", default=None, help="the run's mask_device (default: the policy's)")
    p.add_argument("--fit-arg", action="append", default=[], help="an extra train.py flag (repeat; --fit-arg=--x=y)")
    p.add_argument("--quick", action="store_true", help="shrink the toy fit to seconds on a CPU")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer

    net = build_net(args.size, args.seed)
    tok = VQSam2MaskTokenizer(net, device=args.device, batch_size=args.batch_size)
    rng = np.random.default_rng(args.seed)
    h, w = args.image_size
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(args.images)]
    result = {
        "size": args.size,
        "device": str(tok.device),
        "device_name": torch.cuda.get_device_name(tok.device) if tok.device.type == "cuda" else _cpu_name(),
        "threads": torch.get_num_threads(),
        "image_size": [h, w],
        "batch_size": args.batch_size,
        "parameters_m": sum(x.numel() for x in net.parameters()) / 1e6,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **throughput(tok, images, args.codes, args.seed),
    }
    print(
        f"VQ-SAM2 {args.size} on {result['device']} ({result['threads']} threads): "
        f"{result['one_by_one_per_s']:.3g} decodes/s one by one, {result['batched_per_s']:.3g} batched "
        f"(x{result['speedup']:.2f}; {result['decodes']} decodes on {args.images} images; "
        f"same masks: {result['equal_masks']})"
    )
    if args.fit:
        with tempfile.TemporaryDirectory() as tmp:
            result["fit"] = fit_share(build_net(args.size, args.seed), args, Path(tmp))
        f = result["fit"]
        print(
            f"train.py fit, {f['steps']} steps: {f['step_s']:.3g} s; decode {f['decode_s']:.3g} s "
            f"({100 * f['decode_share']:.2f} %, {f['decodes']} code pairs), encode {f['encode_s']:.3g} s "
            f"(tokenizer {100 * f['tokenizer_share']:.2f} % of the steps, on {f['tokenizer_device']})"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
