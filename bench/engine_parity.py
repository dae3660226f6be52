"""The fast rollout engine and the packed / packed_shared update engines against the HF path, on fixed (teacher-forced)
completions.

    python bench/engine_parity.py --model DIR [--out experiments/results/engine_parity.json]   # a saved Qwen2.5-VL dir
    (bench/e2e_gpu.py --parity runs it on the random-weight 3B architecture it builds)

On one rollout of B prompts x G completions sampled by ``fast_generate`` (which also returns each sampled token's
log-prob), with the policy in its training dtype (bf16 on a GPU):

* per-token log-probs of the same completions from the HF forward (``engines.hf.completion_logps``, the ``hf`` update
  engine), the packed engine (``packing.completion_logprobs``), the fast engine's own sampling log-probs, and an
  fp32 copy of the weights through the HF forward: max / mean |difference| over completion tokens. The bf16-vs-fp32
  difference of the HF forward is the yardstick (bf16 noise): the engines should differ from fp32 by no more;
* the GRPO loss (clipped surrogate + k3 KL to a fixed reference, token-mean, as ``GRPOModule``) and its gradient
  through the HF engine (micro-batches) and the packed engine (``packing.policy_backward``): relative loss
  difference and the cosine similarity of the two gradients over every parameter.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _images_and_queries(n: int, size: int):
    from datamodules.toy import generate_split

    recs = generate_split("val", n, seed=3, size=size)
    return [r["image"] for r in recs], [r["conversations"][0]["value"].replace("<image>", "") for r in recs]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()[mask.bool()]
    return {"max": round(float(d.max()), 4), "mean": round(float(d.mean()), 4)}


def run_parity(
    model_dir: str,
    *,
    device: str = "cuda",
    smoke: bool = False,
    prompts: int = 4,
    group: int = 2,
    new_tokens: int = 64,
    micro_batch: int = 4,
) -> dict[str, Any]:
    from core import objective
    from core.rollout import Rollout, completion_mask_from_ids
    from lightning_modules.engines.decode import fast_generate
    from lightning_modules.engines.fast import repeat_encoding
    from lightning_modules.engines.hf import completion_logps
    from lightning_modules.engines.packing import completion_logprobs, pack_rollout, policy_backward
    from lightning_modules.engines.shared_prompt import SHARED_PROMPT
    from lightning_modules.models.loading import load_policy
    from lightning_modules.models.prompts import build_prompt_text, eos_token_ids, special_token_ids, untokenizable_ids

    dtype = "bf16" if device.startswith("cuda") else "fp32"
    if smoke:
        prompts, group, new_tokens, micro_batch = 2, 2, 8, 2
    policy, processor = load_policy(model_dir, dtype=dtype)
    policy.to(device)
    tok = processor.tokenizer
    images, queries = _images_and_queries(prompts, 448 if not smoke else 112)
    texts = [build_prompt_text(processor, q, task="rec", template="syn_grpo") for q in queries]
    enc = processor(text=texts, images=images, return_tensors="pt", padding=True).to(device)
    eos = eos_token_ids(tok)
    g = torch.Generator(device=device).manual_seed(0)
    policy.eval()
    ids, lp_fast = fast_generate(
        policy,
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        group_size=group,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        temperature=1.0,
        suppress_token_ids=special_token_ids(tok, keep=eos) + untokenizable_ids(policy, tok),
        eos_token_ids=eos,
        pad_token_id=tok.pad_token_id,
        generator=g,
        return_logprobs=True,
    )
    rep = repeat_encoding(enc, group)
    mask = completion_mask_from_ids(ids, eos)
    ro = Rollout(
        prompt_ids=rep["input_ids"],
        prompt_mask=rep["attention_mask"],
        completion_ids=ids,
        completion_mask=mask,
        pixel_values=rep["pixel_values"],
        image_grid_thw=rep["image_grid_thw"],
        texts=[""] * ids.shape[0],
        input_wh=[],
        prompt_mm_types=rep.get("mm_token_type_ids"),
    )
    N, T = ids.shape
    rows_all = list(range(N))
    mbs = [rows_all[i : i + micro_batch] for i in range(0, N, micro_batch)]

    def hf_logps(model, rows, grad=False):
        inputs = {k: v.to(device) for k, v in ro.rows(rows).items()}
        with torch.set_grad_enabled(grad):
            return completion_logps(model, inputs, ids[rows], mask[rows])[0]

    with torch.no_grad():
        lp_hf = torch.cat([hf_logps(policy, r) for r in mbs])
        packed = pack_rollout(
            policy,
            prompt_ids=ro.prompt_ids,
            prompt_mask=ro.prompt_mask,
            pixel_values=ro.pixel_values,
            image_grid_thw=ro.image_grid_thw,
            completion_ids=ids,
            completion_mask=mask,
            group_size=group,
            pad_token_id=tok.pad_token_id,
        )
        lp_packed = completion_logprobs(policy, packed, micro_batch_size=micro_batch)[0]
        lp_shared = completion_logprobs(policy, packed, micro_batch_size=micro_batch, layout=SHARED_PROMPT)[0]
        timing = {}  # component timing of the no-grad scoring (the reference forward), warm: both ran just above
        for name, layout in (("packed", None), ("packed_shared", SHARED_PROMPT)):
            _sync(device)
            t0 = time.perf_counter()
            completion_logprobs(policy, packed, micro_batch_size=micro_batch, layout=layout)
            _sync(device)
            timing[name] = round(time.perf_counter() - t0, 4)
        fp32 = copy.deepcopy(policy).float()
        lp_fp32 = torch.cat([hf_logps(fp32, r) for r in mbs])
        del fp32
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    out: dict[str, Any] = {
        "model_dir": model_dir,
        "dtype": dtype,
        "shape": {"prompts": prompts, "group": group, "new_tokens": T, "prompt_tokens": int(enc["input_ids"].shape[1])},
        "logprob_abs_diff": {
            "hf_vs_fp32 (bf16 noise)": _diff(lp_hf, lp_fp32, mask),
            "packed_vs_fp32": _diff(lp_packed, lp_fp32, mask),
            "fast_sampling_vs_fp32": _diff(lp_fast, lp_fp32, mask),
            "packed_vs_hf": _diff(lp_packed, lp_hf, mask),
            "packed_shared_vs_fp32": _diff(lp_shared, lp_fp32, mask),
            "packed_shared_vs_packed": _diff(lp_shared, lp_packed, mask),
            "fast_sampling_vs_hf": _diff(lp_fast, lp_hf, mask),
        },
        "scoring_s (component timing, no grad, same micro-batch budget)": timing,
        "tokens_scored": {
            "packed": int(packed.lengths.sum()),
            "packed_shared": int(packed.lengths.sum() - (group - 1) * packed.comp_start.view(-1, group)[:, 0].sum()),
        },
    }

    # ---- loss and gradient: HF engine (micro-batches) vs packed engine, same advantages and reference
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(N, generator=gen).to(device)
    ref = (lp_fp32 + 0.05 * torch.randn(lp_fp32.shape, generator=gen).to(device)).detach()  # a nearby reference
    m = mask.float()
    total = m.sum()

    def loss_of(logp, rows):
        rows_t = torch.as_tensor(rows, device=device)
        loss, _ = objective.policy_loss(
            logp,
            logp.detach(),
            adv[rows_t],
            m[rows_t],
            clip_low=0.2,
            clip_high=0.2,
            dual_clip=None,
            ref_logp=ref[rows_t],
            kl_coef=0.04,
            kl_estimator="k3",
            aggregation="token-mean",
            max_length=T,
        )
        return loss * (m[rows_t].sum() / total)

    params = [p for p in policy.parameters() if p.requires_grad]
    policy.train()
    policy.zero_grad(set_to_none=True)
    loss_hf = 0.0
    for r in mbs:
        loss = loss_of(hf_logps(policy, r, grad=True), r)
        loss.backward()
        loss_hf += float(loss)
    g_hf = [p.grad.detach().clone() if p.grad is not None else None for p in params]
    policy.zero_grad(set_to_none=True)

    def cosine_to_hf() -> float:
        dot = n_hf = n_pk = 0.0
        for p, gh in zip(params, g_hf):
            gp = p.grad
            if gh is None or gp is None:
                continue
            gh, gp = gh.float(), gp.float()
            dot += float((gh * gp).sum())
            n_hf += float((gh * gh).sum())
            n_pk += float((gp * gp).sum())
        policy.zero_grad(set_to_none=True)
        return dot / math.sqrt(max(n_hf * n_pk, 1e-30))

    res = policy_backward(
        policy, packed, lambda lp, ent, rows: loss_of(lp, rows.tolist()), micro_batch_size=micro_batch
    )
    loss_packed = float(res["loss"])
    cos = cosine_to_hf()
    res = policy_backward(
        policy,
        packed,
        lambda lp, ent, rows: loss_of(lp, rows.tolist()),
        micro_batch_size=micro_batch,
        layout=SHARED_PROMPT,
    )
    loss_shared = float(res["loss"])
    cos_shared = cosine_to_hf()
    out["loss"] = {
        "hf": loss_hf,
        "packed": loss_packed,
        "packed_shared": loss_shared,
        "relative_diff": abs(loss_packed - loss_hf) / max(abs(loss_hf), 1e-12),
        "relative_diff_packed_shared": abs(loss_shared - loss_hf) / max(abs(loss_hf), 1e-12),
    }
    out["grad_cosine_packed_vs_hf"] = round(cos, 5)
    out["grad_cosine_packed_shared_vs_hf"] = round(cos_shared, 5)
    noise = out["logprob_abs_diff"]["hf_vs_fp32 (bf16 noise)"]
    out["verdict"] = {
        "logprobs_within_bf16_noise": all(
            out["logprob_abs_diff"][k]["max"] <= max(1.5 * noise["max"], 1e-4)
            for k in ("packed_vs_fp32", "packed_shared_vs_fp32", "fast_sampling_vs_fp32")
        ),
        "loss_within_1pct": max(out["loss"]["relative_diff"], out["loss"]["relative_diff_packed_shared"]) <= 0.01,
        "grad_cosine_at_least_0.99": min(cos, cos_shared) >= 0.99,
    }
    print(json.dumps(out, indent=1), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a saved Qwen2.5-VL directory")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = run_parity(args.model, device=args.device, smoke=args.smoke)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
