"""COMPONENT PROFILER: the engines' functions timed in isolation (sections 1-3, 5) and `GRPOModule.training_step`
itself (section 4), on one GPU, at the paper's setting, with random-weight Qwen2.5-VL-3B / 7B architectures. Its
figures locate where time goes; what ``train.py`` gives (data module, callbacks, validation, the CLI) is
``bench/e2e_gpu.py``'s (docs/performance.md).

    python bench/grpo_step.py --models 3b,7b --out experiments/results/grpo_step_h200.json
    python bench/grpo_step.py --models 3b --module-only    # only GRPOModule.training_step
    python bench/grpo_step.py --tiny                       # CPU smoke test of every code path (seconds)

The work (never changed to meet a goal): B = 20 prompts x G = 6 completions = 120 sequences; each prompt holds one
448 x 448 image (1024 patches, 256 merged image tokens) and 64 text tokens (vision start / end included); every
completion is exactly 256 tokens (min_new_tokens = max_new_tokens: random weights rarely emit EOS, so lengths are
fixed for every system). Sampling at temperature 1, top-p 1, special tokens suppressed.

Measured, in this order (each phase timed with CUDA synchronisation around it):
1. HF `generate` eager baseline (stock vision attention), at 120 sequences: ms per decode step from two runs of
   different lengths (the difference removes the prefill), and the stock update path on one micro-batch.
2. `fast_generate`: the whole 256-token rollout (vision once per prompt, prefill once per prompt, CUDA-graph decode);
   ms per decode step from a 256-token and a 1-token run.
3. The update: reference log-probs (no grad), old log-probs (no grad, needed when num_iterations > 1), policy
   fwd + bwd over length-bucketed micro-batches (vision once per prompt) + fused AdamW step; with and without
   gradient checkpointing.
4. The whole step: `GRPOModule.training_step` under a Lightning `Trainer` (``run_module_step``): the module's phase
   timer and wall time per step, fast rollout + packed update, fp32 master weights; never a hand-made chain.
5. Correctness on the real architecture: fast_generate's log-probs vs the efficient scorer vs the stock forward.

MFU counts model FLOPs only: 6 x (matmul parameters) x tokens for fwd + bwd (2 x for forward-only passes): decoder
layers over every real token, the LM head over completion tokens only (the positions that are scored), the vision
blocks over 1024 patches per unique image (20), the merger over 256 merged tokens per image; plus attention
(QK^T and PV: 4 x d x L^2 / 2 per causal sequence and layer forward, full for vision windows). Recomputation from
gradient checkpointing is not counted. Peak: 790 TFLOP/s (bf16 dense matmul measured on this workplace's H200s).
"""

from __future__ import annotations

import argparse
import atexit
import copy
import datetime
import gc
import json
import math
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_modules.engines.decode import _ENGINES, fast_generate, release_rollout_cache  # noqa: E402
from lightning_modules.engines.packing import (  # noqa: E402
    completion_logprobs,
    enable_fast_vision_attention,
    image_embeddings,
    model_flops_per_token,
    pack_rollout,
    policy_backward,
)

PEAK_FLOPS = 790e12
SPECIAL_START = 151643  # Qwen2.5 special / added tokens start here; everything above is suppressed in sampling
EOS_IDS = (151645, 151643)
PAD_ID = 151643

# Qwen2.5-VL-3B-Instruct / 7B-Instruct config.json (text and vision parts), written out: no downloads.
_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    hidden_act="silu",
)
CONFIGS = {
    "3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=70,
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(_VISION, out_hidden_size=2048),
        tie=True,
    ),
    "7b": dict(
        text=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            tie_word_embeddings=False,
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=28,
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(_VISION, out_hidden_size=3584),
        tie=False,
    ),
    # CPU smoke test: the same code paths on a model of a few million parameters
    "tiny": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        ),
        vision=dict(
            _VISION,
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
        ),
        tie=True,
    ),
}


def build_config(name: str):
    from transformers import Qwen2_5_VLConfig

    c = CONFIGS[name]
    text = dict(c["text"], bos_token_id=151643, eos_token_id=151645)
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=c["vision"],
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=c["tie"],
    )


def use_tokenizer_ids(cfg, tok) -> None:
    """Point a Qwen2.5-VL config's image / video / vision-boundary token ids at ``tok``'s (a stand-in tokenizer)."""
    for key, t in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        setattr(cfg, key, tok.convert_tokens_to_ids(t))


def build_model(name: str, device, dtype):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = build_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def make_batch(cfg, B: int, text_tokens: int, image_size: int, device, dtype, seed: int = 0):
    """B prompts: (text_tokens - 2) // 4 text, vision_start, 256 image pads, vision_end, the rest text (left-aligned,
    all prompts the same length: no padding)."""
    g = torch.Generator().manual_seed(seed)
    merge = cfg.vision_config.spatial_merge_size
    patch = cfg.vision_config.patch_size
    gh = gw = image_size // patch
    n_img = gh * gw // merge**2
    pre = (text_tokens - 2) // 4
    post = text_tokens - 2 - pre
    rows = []
    for _ in range(B):
        a = torch.randint(0, 150000, (pre,), generator=g)
        b = torch.randint(0, 150000, (post,), generator=g)
        rows.append(
            torch.cat(
                [
                    a,
                    torch.tensor([cfg.vision_start_token_id]),
                    torch.full((n_img,), cfg.image_token_id),
                    torch.tensor([cfg.vision_end_token_id]),
                    b,
                ]
            )
        )
    ids = torch.stack(rows).to(device)
    mask = torch.ones_like(ids)
    grid = torch.tensor([[1, gh, gw]] * B, device=device)
    dim = 3 * cfg.vision_config.temporal_patch_size * patch * patch
    pixels = torch.randn(B * gh * gw, dim, generator=g).to(device=device, dtype=dtype)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid)


def repeat_batch(enc, G: int, image_token_id: int):
    """The B prompts repeated G times (rows grouped), plus mm_token_type_ids: what `generate` / TRL feed the model."""
    counts = enc["image_grid_thw"].prod(-1).tolist()
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    pix = torch.cat([enc["pixel_values"][offs[b] : offs[b + 1]] for b in range(len(counts)) for _ in range(G)])
    ids = enc["input_ids"].repeat_interleave(G, 0)
    return dict(
        input_ids=ids,
        attention_mask=enc["attention_mask"].repeat_interleave(G, 0),
        pixel_values=pix,
        image_grid_thw=enc["image_grid_thw"].repeat_interleave(G, 0),
        mm_token_type_ids=(ids == image_token_id).long(),
    )


class Timer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.s = time.perf_counter() - self.t0


def gib(x: float) -> float:
    return round(x / 2**30, 2)


def flops_update(fl: dict, packed, n_images: int, patches_per_image: int, cfg, passes: float) -> float:
    """Model FLOPs of `passes` x (forward) over the packed batch: passes = 2 (forward), 6 (forward + backward)."""
    tc = cfg.text_config
    tokens = int(packed.lengths.sum())
    comp_tokens = int(packed.completion_mask.sum())
    lens = packed.lengths.double()
    d_attn = tc.num_attention_heads * (tc.hidden_size // tc.num_attention_heads)
    attn = 4 * d_attn * float((lens**2).sum()) / 2 * tc.num_hidden_layers  # causal QK^T + PV, forward
    vc = cfg.vision_config
    merge = vc.spatial_merge_size**2
    win = (vc.window_size // vc.patch_size) ** 2
    n_full = len(vc.fullatt_block_indexes)
    v_attn = (
        n_images * 4 * vc.hidden_size * patches_per_image * (n_full * patches_per_image + (vc.depth - n_full) * win)
    )
    matmul = (
        fl["decoder"] * tokens
        + fl["lm_head"] * comp_tokens
        + fl["vision_blocks"] * n_images * patches_per_image
        + fl["vision_merger"] * n_images * patches_per_image / merge
    )
    return passes / 2 * (2 * matmul + attn + v_attn)


def grpo_loss_fn(packed, old_logp, ref_logp, adv, kl_coef: float, total_tokens: int):
    """Section 3's loss: ``objective.policy_loss`` (clipped surrogate + k3 KL, token-mean over the WHOLE batch) per
    micro-batch, as `GRPOModule` weights it; used only to time `packing.policy_backward` in isolation."""
    from core.objective import policy_loss

    mask_all = packed.completion_mask

    def fn(logp, ent, rows):
        mask = mask_all[rows].to(logp.device)
        old = logp.detach() if old_logp is None else old_logp[rows]
        loss, _ = policy_loss(
            logp, old, adv[rows], mask, ref_logp=ref_logp[rows], kl_coef=kl_coef, aggregation="token-mean"
        )
        return loss * (int(mask.sum()) / total_tokens)

    return fn


def run_module_step(name: str, args, device, result: dict, save) -> None:
    """The whole GRPO step as ``train.py`` runs it: `GRPOModule.training_step` (plan -> generate -> score ->
    advantage -> update -> log) under a Lightning `Trainer`, on random-weight ``name`` saved with ``save_pretrained``
    and toy scenes at ``--image-size``; the module's own phase timer (``train/time/*``) and the wall time per step.
    Nothing here re-assembles the step; ``bench/e2e_gpu.py`` adds the data module, callbacks and the CLI."""
    import tempfile

    import lightning as L

    from bench.e2e_gpu import build_qwen
    from datamodules.toy import ToySceneDataset
    from lightning_modules.grpo import GRPOModule

    r = result.setdefault("models", {}).setdefault(name, {})
    work = Path(tempfile.mkdtemp(prefix="grpo_step_"))
    atexit.register(shutil.rmtree, work, True)  # the built model (GBs for 3B / 7B) goes when the script ends
    build = build_qwen(work / f"qwen-{name}", name, str(device), vocab_size=512 if name == "tiny" else 4096)
    cuda = device.type == "cuda"
    steps = max(2, args.module_steps)
    data = ToySceneDataset("train", args.prompts * steps, seed=0, size=max(args.image_size, 64))
    loader = torch.utils.data.DataLoader(data, batch_size=args.prompts, collate_fn=list)
    module = GRPOModule(
        policy={"model_name_or_path": build["path"], "dtype": "bf16" if cuda else "fp32"},
        sampling={
            "prompt_template": "syn_grpo",
            "group_size": args.group,
            "max_new_tokens": args.new_tokens,
            "min_new_tokens": args.new_tokens,
        },
        engines={
            "rollout_engine": "fast",
            "rollout_compile": cuda,
            "update_engine": "packed",
            "micro_batch_size": args.micro_batch,
            "ref_micro_batch_size": args.ref_micro_batch,
            "vision_checkpointing": cuda,
        },
    )

    class Record(L.Callback):
        def __init__(self):
            self.rows: list[dict] = []
            self.t = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            logged = {k: float(v) for k, v in trainer.logged_metrics.items() if k.startswith("train/")}
            self.rows.append({"wall_s": round(time.perf_counter() - self.t, 3), **logged})

    rec = Record()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-true" if cuda else "32-true",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(module, train_dataloaders=loader)
    later = rec.rows[1:] or rec.rows
    med = lambda key: round(statistics.median(row.get(key, 0.0) for row in later), 3)  # noqa: E731
    r["module_step"] = dict(
        what="GRPOModule.training_step under a Trainer (fast rollout + packed update, fp32 masters on CUDA)",
        steps=len(rec.rows),
        first_step_s=rec.rows[0]["wall_s"],
        median_step_s=med("wall_s"),
        phases_s={k: med(f"train/time/{k}_s") for k in ("rollout", "rewards", "reference", "update", "optimizer")},
        peak_mem_gib=med("train/peak_mem_gib") if cuda else None,
        completion_length=med("train/completion_length"),
    )
    print(f"[{name}] GRPOModule.training_step: {r['module_step']}", flush=True)
    save()
    del module, trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def run_model(name: str, args, device, dtype, result: dict, save) -> None:
    r = result.setdefault("models", {}).setdefault(name, {})
    B, G, T = args.prompts, args.group, args.new_tokens
    N = B * G
    t_build = time.perf_counter()
    model = build_model(name, device, dtype)
    cfg = model.config
    r["params_total"] = sum(p.numel() for p in model.parameters())
    r["params_vision"] = sum(p.numel() for p in model.model.visual.parameters())
    fl = model_flops_per_token(model)
    r["matmul_params"] = fl
    r["build_s"] = round(time.perf_counter() - t_build, 1)
    enc = make_batch(cfg, B, args.text_tokens, args.image_size, device, dtype)
    P = enc["input_ids"].shape[1]
    patches = int(enc["image_grid_thw"][0].prod())
    r["shape"] = dict(
        prompts=B,
        group=G,
        sequences=N,
        prompt_tokens=P,
        image_tokens=patches // 4,
        new_tokens=T,
        sequence_tokens=P + T,
        total_tokens=N * (P + T),
    )
    suppress = list(range(SPECIAL_START, cfg.text_config.vocab_size))
    gen_kw = dict(suppress_token_ids=suppress, eos_token_ids=EOS_IDS, pad_token_id=PAD_ID)
    print(f"[{name}] {r['params_total'] / 1e9:.2f}B params, prompt {P} tokens, {N} sequences", flush=True)

    # ---- 1. stock baselines (before the vision attention is patched) -------------------------------------------
    if not args.skip_hf:
        rep = repeat_batch(enc, G, cfg.image_token_id)
        warm = repeat_batch(
            {k: (v[:1] if k != "pixel_values" else v[:patches]) for k, v in enc.items()}, G, cfg.image_token_id
        )
        with torch.no_grad():  # warm-up: kernels, cuBLAS handles
            model.generate(
                **warm,
                do_sample=True,
                top_k=0,
                max_new_tokens=2,
                min_new_tokens=2,
                suppress_tokens=suppress,
                pad_token_id=PAD_ID,
            )
        hf = {}
        for n_new in args.hf_steps:
            with torch.no_grad(), Timer(device) as t:
                model.generate(
                    **rep,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=n_new,
                    min_new_tokens=n_new,
                    suppress_tokens=suppress,
                    pad_token_id=PAD_ID,
                    eos_token_id=list(EOS_IDS),
                )
            hf[n_new] = t.s
        a, b = args.hf_steps
        step = (hf[b] - hf[a]) / (b - a)
        r["hf_generate_eager"] = dict(
            runs_s={str(k): round(v, 3) for k, v in hf.items()},
            ms_per_decode_step=round(1e3 * step, 2),
            tokens_per_s_decode=round(N / step, 1),
            prefill_s_est=round(hf[a] - a * step, 3),
            rollout_256_s_est=round(hf[a] - a * step + T * step, 2),
        )
        print(f"[{name}] HF generate eager: {1e3 * step:.1f} ms/step", flush=True)
        # stock update path on one micro-batch (model(**inputs) with pixel_values per row, full logits)
        mb = args.micro_batch
        sub = repeat_batch({k: v for k, v in enc.items()}, G, cfg.image_token_id)
        comp = torch.randint(0, 150000, (mb, T), device=device)
        ids = torch.cat([sub["input_ids"][:mb], comp], 1)
        am = torch.ones_like(ids)
        pix = sub["pixel_values"][: mb * patches]
        model.train()
        for _ in range(2):
            with Timer(device) as t:
                out = model(
                    input_ids=ids,
                    attention_mask=am,
                    pixel_values=pix,
                    image_grid_thw=sub["image_grid_thw"][:mb],
                    mm_token_type_ids=(ids == cfg.image_token_id).long(),
                    logits_to_keep=T + 1,
                )
                lp = out.logits[:, :-1].float().log_softmax(-1).gather(-1, comp[..., None])
                lp.mean().backward()
            del out, lp
            model.zero_grad(set_to_none=True)
        model.eval()
        r["stock_update_one_microbatch"] = dict(
            micro_batch=mb, fwd_bwd_s=round(t.s, 3), extrapolated_120_s=round(t.s * N / mb, 2)
        )
        print(f"[{name}] stock fwd+bwd, one micro-batch of {mb}: {t.s:.2f} s", flush=True)
        del rep, sub
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        save()

    # ---- 2. fast rollout ---------------------------------------------------------------------------------------
    enable_fast_vision_attention(model)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad(), Timer(device) as tv:
        image_embeddings(model, enc["pixel_values"], enc["image_grid_thw"])
    best_variant, best_step = None, math.inf
    for variant in args.decode_variants:
        key = "fast_generate" if variant == "graph" else f"fast_generate_{variant}"
        vkw = dict(gen_kw, compile_step=variant == "compile")
        try:
            with Timer(device) as t_first:
                fast_generate(model, **enc, group_size=G, max_new_tokens=T, min_new_tokens=T, generator=gen, **vkw)
            runs = []
            for _ in range(args.repeats):
                with Timer(device) as t:
                    completion = fast_generate(
                        model, **enc, group_size=G, max_new_tokens=T, min_new_tokens=T, generator=gen, **vkw
                    )
                runs.append(t.s)
            with Timer(device) as t1:
                fast_generate(model, **enc, group_size=G, max_new_tokens=1, min_new_tokens=1, generator=gen, **vkw)
        except Exception as err:  # a failed variant is recorded, the others still run
            r[key] = dict(error=f"{type(err).__name__}: {err}"[:400])
            print(f"[{name}] {key} failed: {r[key]['error']}", flush=True)
            release_rollout_cache(model)
            save()
            continue
        roll = min(runs)
        step = (roll - t1.s) / (T - 1)
        eng = _ENGINES.get(model, {}).get(N)
        replay_ms = None
        if eng is not None and eng.graph is not None:  # the captured forward alone (no sampling), 50 replays
            eng.slot.fill_(P)
            eng.j.fill_(0)
            with Timer(device) as tr:
                for _ in range(50):
                    eng.graph.replay()
            replay_ms = round(1e3 * tr.s / 50, 3)
            eng.slot.fill_(P)
            eng.j.fill_(0)
        r[key] = dict(
            first_call_s=round(t_first.s, 2),
            rollout_s=round(roll, 3),
            rollout_runs_s=[round(x, 3) for x in runs],
            prefill_and_first_token_s=round(t1.s, 3),
            vision_20_images_s=round(tv.s, 3),
            ms_per_decode_step=round(1e3 * step, 2),
            tokens_per_s_decode=round(N / step, 1),
            tokens_per_s_rollout=round(N * T / roll, 1),
            cuda_graph=eng is not None and eng.graph is not None,
            compiled=variant == "compile",
            capture_error=getattr(eng, "capture_error", None),
            graph_replay_ms=replay_ms,
            shape=list(completion.shape),
        )
        if "hf_generate_eager" in r:
            r[key]["speedup_per_step_vs_hf_eager"] = round(
                r["hf_generate_eager"]["ms_per_decode_step"] / (1e3 * step), 1
            )
        print(
            f"[{name}] {key}: {roll:.2f} s rollout, {1e3 * step:.2f} ms/step, first call {t_first.s:.1f} s", flush=True
        )
        if step < best_step:
            best_variant, best_step = variant, step
        save()
    r["decode_variant_used_for_step"] = best_variant

    # ---- 3. update ---------------------------------------------------------------------------------------------
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    release_rollout_cache(ref)
    cmask = torch.ones_like(completion)
    packed = pack_rollout(
        model,
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        completion_ids=completion,
        completion_mask=cmask,
        group_size=G,
        pad_token_id=PAD_ID,
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=device.type == "cuda")
    adv = torch.randn(N, device=device)
    f_fwd = flops_update(fl, packed, B, patches, cfg, 2)
    f_fb = flops_update(fl, packed, B, patches, cfg, 6)
    upd = {}
    for ckpt in args.ckpt_modes:
        model.train()
        res = None
        for _ in range(2):  # warm-up, timed
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                with Timer(device) as t_ref:
                    ref_lp, _ = completion_logprobs(ref, packed, micro_batch_size=args.ref_micro_batch)
                with Timer(device) as t_old:
                    old_lp, _ = completion_logprobs(model, packed, micro_batch_size=args.ref_micro_batch)
                loss_fn = grpo_loss_fn(packed, old_lp, ref_lp, adv, 0.04, int(packed.completion_mask.sum()))
                with Timer(device) as t_fb:
                    policy_backward(
                        model, packed, loss_fn, micro_batch_size=args.micro_batch, gradient_checkpointing=ckpt
                    )
                with Timer(device) as t_opt:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            except torch.OutOfMemoryError as err:
                res = dict(error=f"OOM: {str(err)[:200]}")
                opt.zero_grad(set_to_none=True)
                gc.collect()
                torch.cuda.empty_cache()
                break
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
            res = dict(
                ref_logp_s=round(t_ref.s, 3),
                old_logp_s=round(t_old.s, 3),
                fwd_bwd_s=round(t_fb.s, 3),
                optimizer_s=round(t_opt.s, 3),
                peak_mem_gib=gib(peak),
                mfu_fwd_bwd=round(f_fb / t_fb.s / PEAK_FLOPS, 3),
                mfu_ref=round(f_fwd / t_ref.s / PEAK_FLOPS, 3),
                mfu_update_mu1=round((f_fb + f_fwd) / (t_fb.s + t_ref.s + t_opt.s) / PEAK_FLOPS, 3),
                update_s_mu1=round(t_ref.s + t_fb.s + t_opt.s, 3),
                update_s_mu2=round(t_ref.s + t_old.s + 2 * (t_fb.s + t_opt.s), 3),
            )
        upd["ckpt" if ckpt else "no_ckpt"] = res
        print(f"[{name}] update (grad ckpt {ckpt}): {res}", flush=True)
        save()
    model.eval()
    r["update"] = upd
    r["flops"] = dict(
        fwd_bwd_tflop=round(f_fb / 1e12, 1),
        fwd_tflop=round(f_fwd / 1e12, 1),
        tokens=packed.num_tokens,
        completion_tokens=int(packed.completion_mask.sum()),
    )
    save()

    # ---- 4. the whole step: GRPOModule.training_step (see run_module_step), timed after this function ----------

    # ---- 5. correctness on the real architecture -------------------------------------------------------------------
    sub = {k: (v[:2] if k != "pixel_values" else v[: 2 * patches]) for k, v in enc.items()}
    g2 = torch.Generator(device=device).manual_seed(1)
    toks, lp_gen = fast_generate(
        model, **sub, group_size=2, max_new_tokens=16, min_new_tokens=16, generator=g2, return_logprobs=True, **gen_kw
    )
    pk = pack_rollout(
        model,
        prompt_ids=sub["input_ids"],
        prompt_mask=sub["attention_mask"],
        pixel_values=sub["pixel_values"],
        image_grid_thw=sub["image_grid_thw"],
        completion_ids=toks,
        completion_mask=torch.ones_like(toks),
        group_size=2,
        pad_token_id=PAD_ID,
    )
    lp_eff, _ = completion_logprobs(model, pk)
    rep2 = repeat_batch(sub, 2, cfg.image_token_id)
    ids = torch.cat([rep2["input_ids"], toks], 1)
    with torch.no_grad():
        logits = (
            model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=rep2["pixel_values"],
                image_grid_thw=rep2["image_grid_thw"],
                mm_token_type_ids=(ids == cfg.image_token_id).long(),
                logits_to_keep=17,
            )
            .logits[:, :-1]
            .float()
        )
    lp_stock = logits.log_softmax(-1).gather(-1, toks[..., None])[..., 0]
    del ref, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # float32 reference: the same weights upcast, stock forward (how far is each bf16 path from exact?)
    m32 = copy.deepcopy(model).float()
    with torch.no_grad():
        logits32 = m32(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=rep2["pixel_values"].float(),
            image_grid_thw=rep2["image_grid_thw"],
            mm_token_type_ids=(ids == cfg.image_token_id).long(),
            logits_to_keep=17,
        ).logits[:, :-1]
    lp32 = logits32.log_softmax(-1).gather(-1, toks[..., None])[..., 0]
    del m32, logits32

    def d(a, b):
        return dict(max=round(float((a - b).abs().max()), 4), mean=round(float((a - b).abs().mean()), 5))

    r["check"] = dict(
        rows=4,
        tokens=16,
        fast_vs_stock_bf16=d(lp_gen, lp_stock),
        efficient_vs_stock_bf16=d(lp_eff, lp_stock),
        stock_bf16_vs_fp32=d(lp_stock, lp32),
        fast_bf16_vs_fp32=d(lp_gen, lp32),
        efficient_bf16_vs_fp32=d(lp_eff, lp32),
        mean_logp=round(float(lp32.mean()), 3),
    )
    print(f"[{name}] check: {r['check']}", flush=True)
    save()
    del model
    release_rollout_cache()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


TRL_CORPUS = [
    "the small red circle on the left of the blue square",
    "find every green triangle near the top of the image",
    "<think>look at the shapes</think><answer>[12, 40, 96, 120]</answer>",
    "a striped background with many small objects",
] * 10


def run_trl(name: str, args, device, dtype, result: dict, save) -> None:
    """TRL's GRPOTrainer (use_vllm=False) on the same work: same architecture and random weights, 20 prompts x 6,
    one 448x448 image and 64 text tokens per prompt, 256 new tokens (min_new_tokens), k3 KL (beta 0.04) against a
    bf16 reference, token-mean loss (TRL "dapo"), micro-batch 8, one optimizer step per generation batch.

    Offline there is no Qwen tokenizer: a byte-level BPE tokenizer with Qwen2.5-VL's special tokens
    (`tiny_model.train_bpe_tokenizer`) and a Qwen2.5-VL processor (`tiny_model.build_processor`) stand in, and the model's
    special-token ids are set to that tokenizer's. Ids the small tokenizer cannot decode are suppressed in sampling
    (the compute per step is the same: logits over the full vocabulary). TRL builds its reference model from the
    policy's path; here it is a deep copy of the policy (same bf16 weights).
    """
    import random

    import trl.trainer.grpo_trainer as trl_grpo
    from PIL import Image
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lightning_modules.models.tiny_model import build_processor, train_bpe_tokenizer

    r = result.setdefault("trl_runs", {}).setdefault(name, {})
    import trl as trl_mod

    r["trl_version"] = trl_mod.__version__
    B, G, T = args.prompts, args.group, args.new_tokens
    tok = train_bpe_tokenizer(TRL_CORPUS, vocab_size=1024)
    processor = build_processor(tok, image_size=args.image_size)
    # prompt text so that the rendered prompt holds `text_tokens` text tokens (vision start / end included)
    want = args.text_tokens + 1  # + the single <|image_pad|> placeholder before expansion
    words = "abcdefghijklmnopqrstuvwxyz"
    text = ""
    i = 0
    while True:
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        rendered = processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        n = len(tok(rendered)["input_ids"])
        if n >= want or i > 2000:
            break
        text += f" {words[i % 26]}{words[(i // 26) % 26]}"
        i += 1
    r["prompt_text_tokens"] = n - 1
    model = build_model(name, device, dtype)
    cfg = model.config
    use_tokenizer_ids(cfg, tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    vocab = cfg.text_config.vocab_size
    suppress = sorted(set(tok.all_special_ids) - {eos}) + list(range(len(tok), vocab))
    trl_grpo.create_model_from_path = lambda *a, **k: copy.deepcopy(model).eval()  # the reference: same weights
    rng = random.Random(0)
    side = args.image_size

    import datasets.arrow_dataset
    from datasets import Dataset

    # datasets hashes new tables with dill; some pyarrow / dill pairs cannot pickle pyarrow's types. A fixed
    # fingerprint (nothing is cached here) sidesteps that.
    datasets.arrow_dataset.generate_fingerprint = lambda *_a, **_k: "syn-grpo-bench"

    n_rows = B * max(2, args.trl_steps)
    images = [
        Image.fromarray((torch.rand(side, side, 3, generator=torch.Generator().manual_seed(i)) * 255).byte().numpy())
        for i in range(n_rows)
    ]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": text}]] * n_rows, "image": images})

    def reward(prompts, completions, **kw):
        return [rng.random() for _ in completions]

    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    mb = args.micro_batch
    conf = GRPOConfig(
        output_dir="/tmp/trl_out",
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=B * G // mb,
        num_generations=G,
        max_completion_length=T,
        temperature=1.0,
        top_p=1.0,
        beta=0.04,
        loss_type="dapo",
        num_iterations=1,
        learning_rate=1e-6,
        max_steps=args.trl_steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=device.type == "cuda",
        use_cpu=device.type != "cuda",
        use_vllm=False,
        dataloader_num_workers=0,
        seed=0,
        generation_kwargs={"min_new_tokens": T, "suppress_tokens": suppress},
    )
    r["config"] = dict(
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=B * G // mb,
        generation_batch_size=conf.generation_batch_size,
        gradient_checkpointing=conf.gradient_checkpointing,
        loss_type=conf.loss_type,
        beta=conf.beta,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=conf,
        train_dataset=dataset,
        processing_class=processor,
        callbacks=[StepTimer()],
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    r["step_s"] = [round(x, 2) for x in times]
    r["peak_mem_gib"] = gib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else 0.0
    ours = result.get("models", {}).get(name, {}).get("step", {}).get("total_s")
    if ours and times:
        r["ratio_trl_over_ours"] = round(min(times[1:] or times) / ours, 2)
    print(f"[{name}] TRL GRPOTrainer steps: {r['step_s']}", flush=True)
    save()
    trainer = model = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="3b", help="comma list of 3b, 7b")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--ref-micro-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hf-steps", default="8,40", help="two generate lengths whose time difference gives ms/step")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--decode-variants", default="graph", help="comma list: graph (CUDA graph), compile (+torch.compile)"
    )
    ap.add_argument("--ckpt-modes", default="0,1", help="gradient checkpointing settings to measure (0 and/or 1)")
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer on the same work")
    ap.add_argument("--trl-only", action="store_true", help="run only TRL's GRPOTrainer")
    ap.add_argument("--trl-steps", type=int, default=2, help="TRL optimizer steps (the first one warms up)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model and a small batch")
    ap.add_argument("--module-steps", type=int, default=3, help="GRPOModule.training_step calls to time (section 4)")
    ap.add_argument("--module-only", action="store_true", help="time only GRPOModule.training_step (section 4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.hf_steps = [int(x) for x in args.hf_steps.split(",")]
    args.ckpt_modes = [bool(int(x)) for x in args.ckpt_modes.split(",")]
    args.decode_variants = args.decode_variants.split(",")
    if args.tiny:
        args.models, args.prompts, args.group, args.new_tokens, args.image_size = "tiny", 2, 3, 6, 56
        args.hf_steps, args.micro_batch, args.repeats = [2, 4], 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers

    result = dict(
        date=datetime.date.today().isoformat(),
        command="python " + " ".join(sys.argv),
        device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
        dtype=str(dtype),
        attn="sdpa",
        peak_flops=PEAK_FLOPS,
        setting=dict(
            prompts=args.prompts,
            group=args.group,
            text_tokens=args.text_tokens,
            image_size=args.image_size,
            new_tokens=args.new_tokens,
            micro_batch=args.micro_batch,
            temperature=1.0,
            top_p=1.0,
        ),
        trl="see trl_runs" if (args.trl or args.trl_only) else "not run (pass --trl)",
    )
    out = Path(args.out) if args.out else None

    def save():
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1))

    for name in args.models.split(","):
        try:
            if not args.trl_only and not args.module_only:
                run_model(name.strip(), args, device, dtype, result, save)
            if not args.trl_only:
                run_module_step(name.strip(), args, device, result, save)
            if args.trl or args.trl_only:
                try:
                    run_trl(name.strip(), args, device, dtype, result, save)
                except Exception as err:  # report, never fake
                    import traceback

                    traceback.print_exc()
                    result.setdefault("trl_runs", {})[name] = {"error": f"{type(err).__name__}: {err}"[:600]}
                    save()
        except Exception as err:  # keep what was measured; record the failure
            import traceback

            traceback.print_exc()
            result.setdefault("models", {}).setdefault(name, {})["error"] = f"{type(err).__name__}: {err}"[:500]
            save()
            release_rollout_cache()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    save()
    print_table(result)


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  torch {result['torch']}  transformers {result['transformers']}  {result['date']}")
    rows = []
    for name, r in result.get("models", {}).items():
        hf = r.get("hf_generate_eager", {})
        fg = r.get("fast_generate", {})
        up = r.get("update", {})
        st = r.get("module_step", {})
        rows.append((name, "HF generate eager, ms/step", hf.get("ms_per_decode_step")))
        rows.append((name, "fast_generate, ms/step", fg.get("ms_per_decode_step")))
        rows.append(
            (name, "fast_generate + compile, ms/step", r.get("fast_generate_compile", {}).get("ms_per_decode_step"))
        )
        rows.append((name, "fast_generate, tokens/s (decode)", fg.get("tokens_per_s_decode")))
        rows.append((name, "fast_generate, whole rollout s", fg.get("rollout_s")))
        rows.append(
            (
                name,
                "stock fwd+bwd (1 micro-batch x N/mb), s",
                r.get("stock_update_one_microbatch", {}).get("extrapolated_120_s"),
            )
        )
        for k, v in up.items():
            if v and "error" not in v:
                rows.append((name, f"[{k}] ref log-probs s", v["ref_logp_s"]))
                rows.append((name, f"[{k}] fwd+bwd s (MFU)", f"{v['fwd_bwd_s']} ({100 * v['mfu_fwd_bwd']:.0f}%)"))
                rows.append((name, f"[{k}] optimizer s", v["optimizer_s"]))
                rows.append((name, f"[{k}] peak GiB", v["peak_mem_gib"]))
            elif v:
                rows.append((name, f"[{k}] update", v["error"][:60]))
        rows.append((name, "GRPOModule.training_step s (median after the first)", st.get("median_step_s")))
        rows.append((name, "  phases s (rollout/rewards/reference/update/optimizer)", st.get("phases_s")))
        rows.append(
            (
                name,
                "check |dlogp| vs fp32: stock/fast/efficient (max)",
                tuple(
                    r.get("check", {}).get(k, {}).get("max")
                    for k in ("stock_bf16_vs_fp32", "fast_bf16_vs_fp32", "efficient_bf16_vs_fp32")
                ),
            )
        )
        if "error" in r:
            rows.append((name, "ERROR", r["error"][:80]))
    for row in rows:
        print(f"{row[0]:>5}  {row[1]:<42} {row[2]}")


if __name__ == "__main__":
    main()
