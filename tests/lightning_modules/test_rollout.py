"""The fast rollout engine and the efficient update helpers agree with transformers on a tiny random Qwen2.5-VL.

The reference is always the stock model: `generate` for tokens (greedy: the same ids; sampling: the same
distribution, by a two-sample chi-square test on first and later tokens), and a teacher-forced `forward` with
mRoPE positions (``mm_token_type_ids``) for log-probs.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402

from lightning_modules.engines.decode import fast_generate, mrope_positions  # noqa: E402

VOCAB = 320
IMG, VSTART, VEND, EOS, PAD = 310, 308, 309, 300, 301
SPECIALS = list(range(300, VOCAB))  # ids >= 300 are special in this toy vocabulary


def _config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=PAD,
            eos_token_id=EOS,
            pad_token_id=PAD,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=IMG,
        video_token_id=311,
        vision_start_token_id=VSTART,
        vision_end_token_id=VEND,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Qwen2_5_VLForConditionalGeneration(_config()).eval()
    # Sharper than the default init, so that greedy ties are unlikely and sampling tests have structure.
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    return m


def _prompts(grids=((1, 4, 4), (1, 4, 6)), text=((5, 7), (2, 9)), seed=1):
    """B left-padded prompts: text, vision_start, image_pad * n, vision_end, text; with pixel_values and grids."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for (t, h, w), (a, b) in zip(grids, text):
        n = t * h * w // 4
        rows.append(
            torch.randint(0, 300, (a,), generator=g).tolist()
            + [VSTART]
            + [IMG] * n
            + [VEND]
            + torch.randint(0, 300, (b,), generator=g).tolist()
        )
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), PAD)
    mask = torch.zeros(len(rows), P, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, P - len(r) :] = torch.tensor(r)
        mask[i, P - len(r) :] = 1
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g)
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid)


def _repeat(enc, G):
    """The B prompts repeated G times (rows grouped by prompt), as `generate` needs them."""
    counts = enc["image_grid_thw"].prod(-1).tolist()
    offs = [0] + torch.tensor(counts).cumsum(0).tolist()
    pix = torch.cat([enc["pixel_values"][offs[b] : offs[b + 1]] for b in range(len(counts)) for _ in range(G)])
    ids = enc["input_ids"].repeat_interleave(G, 0)
    return dict(
        input_ids=ids,
        attention_mask=enc["attention_mask"].repeat_interleave(G, 0),
        pixel_values=pix,
        image_grid_thw=enc["image_grid_thw"].repeat_interleave(G, 0),
        mm_token_type_ids=(ids == IMG).long(),
    )


def _hf_generate(model, enc, G, **kw):
    rep = _repeat(enc, G)
    out = model.generate(**rep, pad_token_id=PAD, **kw)
    return out[:, rep["input_ids"].shape[1] :]


def _teacher_forced_logps(model, enc, G, completion):
    """log p(completion token t | prompt, tokens < t) from one stock forward with mRoPE positions."""
    rep = _repeat(enc, G)
    ids = torch.cat([rep["input_ids"], completion], 1)
    mask = torch.cat([rep["attention_mask"], torch.ones_like(completion)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=rep["pixel_values"],
            image_grid_thw=rep["image_grid_thw"],
            mm_token_type_ids=(ids == IMG).long(),
        ).logits
    T = completion.shape[1]
    logp = logits[:, -T - 1 : -1].float().log_softmax(-1)
    return logp.gather(-1, completion[..., None])[..., 0]


def test_mrope_positions_match_transformers(model):
    enc = _prompts(grids=((1, 4, 4), (1, 6, 4), (1, 2, 8)), text=((3, 4), (1, 1), (6, 2)))
    ids, mask = enc["input_ids"], enc["attention_mask"]
    ref, ref_delta = model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMG).long(), image_grid_thw=enc["image_grid_thw"], attention_mask=mask
    )
    pos, next_pos = mrope_positions(model.config, ids, mask, enc["image_grid_thw"])
    valid = mask.bool()
    assert torch.equal(pos[:, valid], ref[:, valid])
    # transformers: generated token j sits at (prompt length + j) + rope_delta
    assert torch.equal(next_pos, mask.sum(-1) + ref_delta.view(-1))


def test_greedy_matches_generate(model):
    enc = _prompts()
    G, T = 3, 12
    ref = _hf_generate(model, enc, G, do_sample=False, max_new_tokens=T, min_new_tokens=T, suppress_tokens=SPECIALS)
    out = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        temperature=0.0,
        suppress_token_ids=SPECIALS,
        eos_token_ids=[EOS],
        pad_token_id=PAD,
        min_new_tokens=T,
    )
    assert out.shape == ref.shape == (2 * G, T)
    assert torch.equal(out, ref)


def test_greedy_eos_and_padding_match_generate(model):
    enc = _prompts()
    G, T = 2, 10
    # Make the EOS a token that greedy decoding reaches in one row at step 3 (and suppress the other specials).
    free = _hf_generate(model, enc, 1, do_sample=False, max_new_tokens=T, suppress_tokens=SPECIALS)
    eos = int(free[0, 3])
    suppress = [s for s in SPECIALS]
    ref = _hf_generate(model, enc, G, do_sample=False, max_new_tokens=T, suppress_tokens=suppress, eos_token_id=eos)
    out = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        temperature=0.0,
        suppress_token_ids=suppress,
        eos_token_ids=[eos],
        pad_token_id=PAD,
    )
    assert torch.equal(out, ref), (out, ref)
    # every position after a row's first EOS is pad
    for row in out.tolist():
        if eos in row:
            k = row.index(eos)
            assert all(t == PAD for t in row[k + 1 :])


def test_min_new_tokens_masks_eos(model):
    enc = _prompts()
    free = fast_generate(model, **enc, group_size=1, max_new_tokens=6, temperature=0.0, suppress_token_ids=SPECIALS)
    eos = int(free[0, 0])  # the very first greedy token of row 0 becomes the EOS
    out = fast_generate(
        model,
        **enc,
        group_size=2,
        max_new_tokens=6,
        temperature=0.0,
        suppress_token_ids=SPECIALS,
        eos_token_ids=[eos],
        pad_token_id=PAD,
        min_new_tokens=4,
    )
    assert out.shape[1] >= 4
    assert not (out[:, :4] == eos).any()


def test_logprobs_of_generated_tokens_match_teacher_forcing(model):
    """A sampled completion scored by the stock forward: log-probs are finite and greedy is the per-step argmax."""
    enc = _prompts()
    G, T = 2, 16
    gen = torch.Generator().manual_seed(3)
    out = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        suppress_token_ids=SPECIALS,
        eos_token_ids=[EOS],
        pad_token_id=PAD,
        min_new_tokens=T,
        generator=gen,
    )
    logp = _teacher_forced_logps(model, enc, G, out)
    assert torch.isfinite(logp).all()
    # greedy tokens are the argmax of the teacher-forced distribution at every step (positions and cache are right)
    greedy = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        temperature=0.0,
        suppress_token_ids=SPECIALS,
        pad_token_id=PAD,
        min_new_tokens=T,
    )
    rep = _repeat(enc, G)
    ids = torch.cat([rep["input_ids"], greedy], 1)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=torch.cat([rep["attention_mask"], torch.ones_like(greedy)], 1),
            pixel_values=rep["pixel_values"],
            image_grid_thw=rep["image_grid_thw"],
            mm_token_type_ids=(ids == IMG).long(),
        ).logits[:, -T - 1 : -1]
    logits[..., SPECIALS] = -math.inf
    assert torch.equal(logits.argmax(-1), greedy)


def test_returned_logprobs_match_teacher_forcing(model):
    enc = _prompts()
    G, T = 2, 16
    gen = torch.Generator().manual_seed(4)
    out, lp = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        suppress_token_ids=SPECIALS,
        eos_token_ids=[EOS],
        pad_token_id=PAD,
        min_new_tokens=T,
        generator=gen,
        temperature=0.8,
        return_logprobs=True,
    )
    ref = _teacher_forced_logps_t(model, enc, G, out, 0.8)
    torch.testing.assert_close(lp, ref, atol=2e-4, rtol=1e-4)


def _teacher_forced_logps_t(model, enc, G, completion, temperature):
    rep = _repeat(enc, G)
    ids = torch.cat([rep["input_ids"], completion], 1)
    mask = torch.cat([rep["attention_mask"], torch.ones_like(completion)], 1)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=rep["pixel_values"],
            image_grid_thw=rep["image_grid_thw"],
            mm_token_type_ids=(ids == IMG).long(),
        ).logits
    T = completion.shape[1]
    logp = (logits[:, -T - 1 : -1].float() / temperature).log_softmax(-1)
    return logp.gather(-1, completion[..., None])[..., 0]


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor, min_count: int = 5) -> tuple[float, int]:
    """Chi-square statistic of two samples of token ids (rare tokens pooled into one bin) and its degrees of freedom."""
    ca = torch.bincount(a, minlength=VOCAB).double()
    cb = torch.bincount(b, minlength=VOCAB).double()
    keep = (ca + cb) >= min_count
    ca = torch.cat([ca[keep], ca[~keep].sum(0, keepdim=True)])
    cb = torch.cat([cb[keep], cb[~keep].sum(0, keepdim=True)])
    nz = (ca + cb) > 0
    ca, cb = ca[nz], cb[nz]
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    return stat, int(nz.sum()) - 1


def _chi2_bound(df: int) -> float:
    from scipy.stats import chi2

    return float(chi2.ppf(1 - 1e-4, df))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.3, 0.95)])
def test_sampling_distribution_matches_generate(model, temperature, top_p):
    """First and third generated tokens: fast_generate vs generate, two-sample chi-square at alpha = 1e-4 (seeded)."""
    enc = _prompts(grids=((1, 4, 4),), text=((4, 5),))
    G, T = 1000, 3
    torch.manual_seed(11)
    ref = _hf_generate(
        model,
        enc,
        G,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=T,
        min_new_tokens=T,
        suppress_tokens=SPECIALS,
    )
    gen = torch.Generator().manual_seed(12)
    out = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        temperature=temperature,
        top_p=top_p,
        suppress_token_ids=SPECIALS,
        pad_token_id=PAD,
        min_new_tokens=T,
        generator=gen,
    )
    for t in (0, 2):
        stat, df = _two_sample_chi2(out[:, t], ref[:, t])
        assert df > 3, "the test needs several tokens with mass"
        assert stat < _chi2_bound(df), (t, stat, df)
    if temperature != 1.0:
        return
    # power: the same test tells a 10% temperature change apart (third token, the decode path)
    off = fast_generate(
        model,
        **enc,
        group_size=G,
        max_new_tokens=T,
        temperature=temperature * 0.9,
        top_p=top_p,
        suppress_token_ids=SPECIALS,
        pad_token_id=PAD,
        min_new_tokens=T,
        generator=gen,
    )
    stat, df = _two_sample_chi2(off[:, 2], ref[:, 2])
    assert stat > _chi2_bound(df), (stat, df)


def test_first_token_frequencies_match_softmax(model):
    """One-sample check against the exact next-token distribution of the stock forward."""
    enc = _prompts(grids=((1, 4, 4),), text=((4, 5),))
    G = 4000
    gen = torch.Generator().manual_seed(5)
    out = fast_generate(
        model, **enc, group_size=G, max_new_tokens=1, suppress_token_ids=SPECIALS, pad_token_id=PAD, generator=gen
    )
    ids = enc["input_ids"]
    with torch.no_grad():
        logits = model(**enc, mm_token_type_ids=(ids == IMG).long()).logits[0, -1].float()
    logits[SPECIALS] = -math.inf
    p = logits.softmax(-1).double()
    counts = torch.bincount(out[:, 0], minlength=VOCAB).double()
    expected = p * G
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    assert stat < _chi2_bound(int(keep.sum())), stat


def test_suppressed_tokens_never_sampled(model):
    enc = _prompts()
    # suppress the specials and the 20 most likely first tokens
    ids = enc["input_ids"]
    with torch.no_grad():
        logits = model(**enc, mm_token_type_ids=(ids == IMG).long()).logits[:, -1]
    top = logits.topk(20, dim=-1).indices.flatten().unique().tolist()
    suppress = sorted(set(SPECIALS) | set(top))
    gen = torch.Generator().manual_seed(6)
    out = fast_generate(
        model,
        **enc,
        group_size=64,
        max_new_tokens=8,
        suppress_token_ids=suppress,
        pad_token_id=PAD,
        generator=gen,
        temperature=1.5,
    )
    assert not torch.isin(out, torch.tensor(suppress)).any()


def test_early_exit_returns_longest_completion(model):
    enc = _prompts()
    free = fast_generate(model, **enc, group_size=1, max_new_tokens=4, temperature=0.0, suppress_token_ids=SPECIALS)
    # EOS = the first greedy token of both rows: every row stops after one token, like generate's output shape
    eos = sorted({int(free[0, 0]), int(free[1, 0])})
    out = fast_generate(
        model,
        **enc,
        group_size=2,
        max_new_tokens=40,
        temperature=0.0,
        suppress_token_ids=SPECIALS,
        eos_token_ids=eos,
        pad_token_id=PAD,
        check_every=4,
    )
    assert out.shape == (4, 1)


# --------------------------------------------------------------------------------------------------------------------
# engines/packing.py: packed, bucketed scoring and backward agree with the stock forward
# --------------------------------------------------------------------------------------------------------------------


def _completions_with_eos(N, T, seed=7):
    """Random completions; some rows end early with EOS, pad after it (as fast_generate returns them)."""
    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(0, 300, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    for n in range(N):
        if n % 3 == 1:
            k = int(torch.randint(1, T - 1, (1,), generator=g))
            comp[n, k] = EOS
            comp[n, k + 1 :] = PAD
            mask[n, k + 1 :] = 0
    return comp, mask


def _stock_logps(model, enc, G, comp, mask, temperature=1.0):
    rep = _repeat(enc, G)
    ids = torch.cat([rep["input_ids"], comp], 1)
    am = torch.cat([rep["attention_mask"], mask], 1)
    logits = model(
        input_ids=ids,
        attention_mask=am,
        pixel_values=rep["pixel_values"],
        image_grid_thw=rep["image_grid_thw"],
        mm_token_type_ids=(ids == IMG).long(),
    ).logits
    T = comp.shape[1]
    lp = (logits[:, -T - 1 : -1].float() / temperature).log_softmax(-1).gather(-1, comp[..., None])[..., 0]
    return lp * mask


def test_fast_vision_attention_is_exact():
    from lightning_modules.engines.packing import enable_fast_vision_attention

    torch.manual_seed(0)
    m = Qwen2_5_VLForConditionalGeneration(_config()).eval()
    enc = _prompts(grids=((1, 4, 4), (1, 4, 6), (1, 8, 8)), text=((2, 2), (3, 1), (1, 1)))
    with torch.no_grad():
        ref = m.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
        assert enable_fast_vision_attention(m) == 2
        assert enable_fast_vision_attention(m) == 0  # idempotent
        out = m.model.visual(enc["pixel_values"], grid_thw=enc["image_grid_thw"]).pooler_output
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_completion_logprobs_match_stock_forward(model, temperature):
    from lightning_modules.engines.packing import completion_logprobs, pack_rollout

    enc = _prompts()
    G, T = 3, 9
    comp, mask = _completions_with_eos(2 * G, T)
    packed = pack_rollout(
        model,
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        completion_ids=comp,
        completion_mask=mask,
        group_size=G,
        pad_token_id=PAD,
    )
    assert packed.num_tokens == int(enc["attention_mask"].sum() * G + mask.sum())
    lp, ent = completion_logprobs(
        model, packed, micro_batch_size=4, temperature=temperature, with_entropy=True, chunk_tokens=7
    )
    with torch.no_grad():
        ref = _stock_logps(model, enc, G, comp, mask, temperature)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    assert (ent[mask == 0] == 0).all() and (ent[mask == 1] > 0).all()


def test_pack_rollout_accepts_repeated_prompts(model):
    from lightning_modules.engines.packing import pack_rollout

    enc = _prompts()
    G, T = 2, 5
    comp, mask = _completions_with_eos(2 * G, T)
    rep = _repeat(enc, G)
    a = pack_rollout(
        model,
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        completion_ids=comp,
        completion_mask=mask,
        group_size=G,
    )
    b = pack_rollout(
        model,
        prompt_ids=rep["input_ids"],
        prompt_mask=rep["attention_mask"],
        pixel_values=rep["pixel_values"],
        image_grid_thw=rep["image_grid_thw"],
        completion_ids=comp,
        completion_mask=mask,
        group_size=G,
    )
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.positions, b.positions)
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)


@pytest.mark.parametrize("ckpt", [False, True])
def test_policy_backward_gradients_match_stock(ckpt):
    """The same loss through the packed, micro-batched path and through one stock forward: same gradients."""
    from lightning_modules.engines.packing import enable_fast_vision_attention, pack_rollout, policy_backward

    torch.manual_seed(0)
    m = Qwen2_5_VLForConditionalGeneration(_config()).train()
    enc = _prompts()
    G, T = 3, 8
    comp, mask = _completions_with_eos(2 * G, T)
    w = torch.randn(2 * G, T, generator=torch.Generator().manual_seed(9))
    total = mask.sum()

    _stock_logps_loss = (_stock_logps(m, enc, G, comp, mask) * w).sum() / total
    _stock_logps_loss.backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)

    enable_fast_vision_attention(m)
    packed = pack_rollout(
        m,
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        completion_ids=comp,
        completion_mask=mask,
        group_size=G,
        pad_token_id=PAD,
    )
    out = policy_backward(
        m, packed, lambda lp, ent, rows: (lp * w[rows]).sum() / total, micro_batch_size=2, gradient_checkpointing=ckpt
    )
    torch.testing.assert_close(out["loss"], _stock_logps_loss.detach(), atol=1e-5, rtol=1e-5)
    got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for name in (
        "model.visual.patch_embed.proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.language_model.layers.1.mlp.down_proj.weight",
        "model.language_model.embed_tokens.weight",
    ):
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_policy_backward_entropy_gradient_matches_stock():
    from lightning_modules.engines.packing import pack_rollout, policy_backward

    torch.manual_seed(0)
    m = Qwen2_5_VLForConditionalGeneration(_config()).train()
    enc = _prompts()
    G, T = 2, 6
    comp, mask = _completions_with_eos(2 * G, T)
    rep = _repeat(enc, G)
    ids = torch.cat([rep["input_ids"], comp], 1)
    logits = m(
        input_ids=ids,
        attention_mask=torch.cat([rep["attention_mask"], mask], 1),
        pixel_values=rep["pixel_values"],
        image_grid_thw=rep["image_grid_thw"],
        mm_token_type_ids=(ids == IMG).long(),
    ).logits[:, -T - 1 : -1]
    logp = logits.float().log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((ent * mask).sum() / mask.sum()).backward()
    ref = m.lm_head.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    packed = pack_rollout(
        m,
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"],
        pixel_values=enc["pixel_values"],
        image_grid_thw=enc["image_grid_thw"],
        completion_ids=comp,
        completion_mask=mask,
        group_size=G,
        pad_token_id=PAD,
    )
    policy_backward(
        m, packed, lambda lp, e, rows: e.sum() / mask.sum(), micro_batch_size=3, with_entropy=True, entropy_grad=True
    )
    torch.testing.assert_close(m.lm_head.weight.grad, ref, atol=1e-5, rtol=1e-4)
