"""Engines as registered objects: the registry, the shared `generate` contract (group ids, parent ids, shapes), greedy
parity between the rollout engines and log-prob parity between the update engines on the tiny Qwen2.5-VL."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lightning_modules.engines.base import (
    ROLLOUT_ENGINES,
    UPDATE_ENGINES,
    RolloutRequest,
    Sampling,
    build_rollout_engine,
    build_update_engine,
)
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import build_prompt_text


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    torch.manual_seed(0)
    return load_policy(str(tiny_model_dir), dtype="fp32")


def _requests(processor, n, parents=None):
    images = [Image.new("RGB", (112, 112), c) for c in ("red", "blue")]
    qs = ["the small red circle", "red shape"]
    return [
        RolloutRequest(
            build_prompt_text(processor, q, template="toy"), im, n, 10 + i, None if parents is None else parents[i]
        )
        for i, (im, q) in enumerate(zip(images, qs))
    ]


def test_registry_names_the_built_in_engines_and_rejects_unknown_ones():
    assert {"hf", "fast"} <= set(ROLLOUT_ENGINES) and {"hf", "packed"} <= set(UPDATE_ENGINES)
    with pytest.raises(ValueError, match=r"--model.engines.rollout_engine 'vllm2' is not a registered rollout engine"):
        build_rollout_engine("vllm2")
    assert not UPDATE_ENGINES["packed"].distributed_ok and UPDATE_ENGINES["hf"].distributed_ok


@pytest.mark.parametrize("name", ["hf", "fast"])
def test_generate_returns_rows_grouped_with_group_and_parent_ids(policy, name):
    model, processor = policy
    ro = build_rollout_engine(name).generate(
        model, processor, _requests(processor, 3, parents=[4, 5]), Sampling(max_new_tokens=6)
    )
    assert ro.group_size == 3 and ro.group_ids.tolist() == [10, 10, 10, 11, 11, 11]
    assert ro.parent_ids == [4, 4, 4, 5, 5, 5]
    assert ro.completion_ids.shape[0] == 6 and len(ro.texts) == 6 and ro.prompt_ids.shape[0] == 6
    with pytest.raises(ValueError, match="same number of completions"):
        reqs = _requests(processor, 2)
        reqs[1] = RolloutRequest(reqs[1].prompt, reqs[1].image, 3, 1)
        build_rollout_engine(name).generate(model, processor, reqs, Sampling(max_new_tokens=4))


def test_greedy_rollouts_agree_between_engines(policy):
    model, processor = policy
    greedy = Sampling(max_new_tokens=8, greedy=True)
    a = build_rollout_engine("hf").generate(model, processor, _requests(processor, 1), greedy)
    b = build_rollout_engine("fast").generate(model, processor, _requests(processor, 1), greedy)
    assert torch.equal(a.completion_ids, b.completion_ids) and a.texts == b.texts


def test_update_engines_agree_on_logprobs_and_gradients(policy):
    model, processor = policy
    ro = build_rollout_engine("hf").generate(model, processor, _requests(processor, 2), Sampling(max_new_tokens=6))
    out = {}
    for name in ("hf", "packed", "packed_shared"):
        eng = build_update_engine(name, micro_batch_size=3, ref_micro_batch_size=2)
        prepared = eng.prepare(model, processor, ro, torch.device("cpu"))
        lp = eng.logprobs(model, prepared) * ro.completion_mask
        model.zero_grad(set_to_none=True)
        eng.backward(model, prepared, lambda logp, ent, rows: (logp * ro.completion_mask[rows]).sum())
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (lp, grad)
    assert torch.allclose(out["hf"][0], out["packed"][0], atol=1e-4)
    cos = torch.nn.functional.cosine_similarity(out["hf"][1], out["packed"][1], dim=0)
    assert cos > 0.9999, float(cos)
    # the prompt scored once per group: the same function of the weights as its G copies (fp32 rounding apart)
    assert torch.allclose(out["packed"][0], out["packed_shared"][0], atol=1e-5)
    assert torch.allclose(out["packed"][1], out["packed_shared"][1], rtol=1e-4, atol=1e-6)


def test_shared_prompt_layout_with_early_eos_several_groups_per_micro_batch_and_entropy(policy):
    """Completions of unequal lengths (EOS at different steps, one completion of length 1), prompts of unequal lengths
    in one micro-batch (right-padded groups), and a budget that splits 3 groups 2 + 1: the log-probs, entropies and
    gradients of the shared layout equal the row layout's."""
    from lightning_modules.engines.packing import completion_logprobs, pack_rollout, policy_backward
    from lightning_modules.engines.shared_prompt import SHARED_PROMPT, group_micro_batches

    model, processor = policy
    reqs = _requests(processor, 3) + [
        RolloutRequest(
            build_prompt_text(processor, "the large green square on the left", template="toy"),
            Image.new("RGB", (112, 112), "green"),
            3,
            12,
        )
    ]
    ro = build_rollout_engine("hf").generate(model, processor, reqs, Sampling(max_new_tokens=7))
    cm = ro.completion_mask.clone()
    for r, n in enumerate([7, 3, 1, 5, 7, 2, 4, 6, 1]):  # EOS placed by hand: rows end at n tokens
        cm[r, n:] = False
    packed = pack_rollout(
        model,
        prompt_ids=ro.prompt_ids,
        prompt_mask=ro.prompt_mask,
        pixel_values=ro.pixel_values,
        image_grid_thw=ro.image_grid_thw,
        completion_ids=ro.completion_ids,
        completion_mask=cm,
        group_size=3,
        pad_token_id=processor.tokenizer.pad_token_id,
    )
    P = packed.comp_start.view(-1, 3)[:, 0]
    assert len(set(P.tolist())) > 1  # prompts of different lengths
    budget = int(max(P[b] + (packed.lengths.view(-1, 3)[b] - P[b]).sum() for b in range(3))) * 2
    batches = group_micro_batches(packed, max_tokens=budget)
    assert sorted(b for mb in batches for b in mb) == [0, 1, 2] and max(len(mb) for mb in batches) == 2
    out = {}
    for name, layout in (("rows", None), ("shared", SHARED_PROMPT)):
        lp, ent = completion_logprobs(model, packed, with_entropy=True, layout=layout, max_tokens=budget)
        model.zero_grad(set_to_none=True)
        got = policy_backward(
            model,
            packed,
            lambda logp, e, rows: (logp * cm[rows]).sum() + e.sum(),
            with_entropy=True,
            entropy_grad=True,
            layout=layout,
            max_tokens=budget,
        )
        grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        out[name] = (lp, ent, got["loss"], grad)
    for a, b in zip(out["rows"], out["shared"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), float((a - b).abs().max())


def test_fast_engine_encodes_each_image_once_across_requests_and_calls(policy):
    """CycleGRPO's shape: a caption request per image, then N grounding requests per image (the same objects): the
    vision tower runs once per image; greedy completions equal an engine without the cache; a weight change (an
    optimizer step bumps the parameters' versions) or ``on_weights_updated`` drops the cached features."""
    model, processor = policy
    images = [Image.new("RGB", (112, 112), c) for c in ("red", "blue")]
    prompt = build_prompt_text(processor, "the small red circle", template="toy")
    greedy = Sampling(max_new_tokens=6, greedy=True)
    caps = [RolloutRequest(prompt, im, 2, i) for i, im in enumerate(images)]
    grounds = [RolloutRequest(prompt, im, 2, 2 + j) for j, im in enumerate(im for im in images for _ in range(3))]
    engine = build_rollout_engine("fast")
    first = engine.generate(model, processor, caps, greedy)
    assert engine.vision.encoded == 2
    second = engine.generate(model, processor, grounds, greedy)
    assert engine.vision.encoded == 2 and len(second.texts) == 12  # 6 requests of 2 images: no new encoding
    fresh = build_rollout_engine("fast")
    fresh.vision.capacity = 0  # nothing kept between calls: the batch's own duplicates still run once
    assert fresh.generate(model, processor, grounds, greedy).texts == second.texts
    assert fresh.vision.encoded == 2 and first.texts == second.texts[:2] + second.texts[6:8]
    visual = next(model.model.visual.parameters())
    with torch.no_grad():
        visual.mul_(1.0)  # an in-place update: the version moves, the cache is stale
    engine.generate(model, processor, caps, greedy)
    assert engine.vision.encoded == 4
    engine.on_weights_updated(model)
    assert not engine.vision.entries
