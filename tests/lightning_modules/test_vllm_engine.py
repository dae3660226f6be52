"""The ``vllm`` rollout engine, for real, on vLLM's CPU build (``make test-vllm`` runs these in .venv-vllm).

Everything runs the embedded toy checkpoint (fp32) against a real vLLM: in this process (colocate) and in a
``vllm_server`` subprocess (server). What is checked:

- parity with the policy: vLLM's log-probs of its own completions equal the policy's teacher-forced forward;
- parity with the ``hf`` engine: the same prompt encoding, the same greedy completions, the same sampling distribution
  (a digit position where the toy model is uncertain, at temperature 0.7), suppression and ``min_new_tokens``;
- weight sync: after a push the log-probs match within ``SYNC_ATOL``; against the weights of one optimizer step
  earlier they do not (the check raises);
- tiny fits through ``train.py fit --config configs/tiny.yaml`` in both modes, and the GPU configs' vLLM overlay on
  the CPU with the toy model swapped in.

Tolerance. Both sides hold the same fp32 weights; what differs is the kernels (vLLM's packed oneDNN GEMMs and its own
attention against PyTorch's matmul and SDPA), i.e. the summation order: ~1e-7 relative per op, ~1e-5 on a log-prob
after the toy model's 2 + 4 layers (measured: 2e-6 to 2e-5 after every sync). One AdamW step at the tiny config's lr
2e-5 moves every weight by ~2e-5 and the log-probs by 0.1-0.5 (measured). ``SYNC_ATOL`` = 1e-3 sits ~50x above the
first and ~100x below the second.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
from lightning_modules.engines.hf import HFUpdateEngine

REPO = Path(__file__).resolve().parents[2]
TOY = REPO / "checkpoints/toy-qwen2.5-vl"
SYNC_ATOL = 1e-3
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [
    pytest.mark.vllm,
    pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm"),
]


def vllm_test(fn):
    for m in needs_vllm:
        fn = m(fn)
    return fn


# ---------------------------------------------------------------------------------------------- without vLLM
def test_missing_vllm_names_the_venv_to_build():
    if HAS_VLLM:
        pytest.skip("vLLM is installed in this environment")
    from lightning_modules.engines.vllm_backend import import_vllm

    with pytest.raises(ImportError, match="make vllm-venv"):
        import_vllm()


def test_server_mode_needs_a_url():
    with pytest.raises(ValueError, match="rollout_args.url"):
        build_rollout_engine("vllm", mode="server")
    with pytest.raises(ValueError, match="mode"):
        build_rollout_engine("vllm", mode="remote")


# ---------------------------------------------------------------------------------------------- fixtures
def _scene(colour: str, x: int) -> Image.Image:
    im = Image.new("RGB", (168, 112), (235, 235, 235))
    ImageDraw.Draw(im).rectangle([x, 24, x + 56, 80], fill=colour)
    return im


@pytest.fixture(scope="module")
def policy():
    from lightning_modules.models.loading import load_policy

    model, processor = load_policy(str(TOY), dtype="fp32")
    return model.eval(), processor


@pytest.fixture(scope="module")
def requests_(policy):
    from lightning_modules.models.prompts import build_prompt_text

    _, processor = policy
    return [
        RolloutRequest(build_prompt_text(processor, f"the {c} square", template="toy"), _scene(c, x), 6, i)
        for i, (c, x) in enumerate([("red", 20), ("blue", 90)])
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A ``vllm_server`` subprocess on the toy checkpoint (its own process group, killed at the end)."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed here")
    import httpx

    port = _free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_modules.engines.vllm_server", "--model", str(TOY), "--port", str(port)],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm_server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"vllm_server did not answer within 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _close_vllm():
    yield
    if HAS_VLLM:
        from lightning_modules.engines.vllm import shutdown_backends

        shutdown_backends()


@pytest.fixture(params=["colocate", "server"])
def engine(request, tmp_path):
    if request.param == "server":
        url = request.getfixturevalue("server")
        eng = build_rollout_engine("vllm", mode="server", url=url, weights_dir=str(tmp_path / "weights"))
    else:
        eng = build_rollout_engine("vllm")
    yield eng
    if request.param == "server":
        eng.close()  # the client only: the colocated vLLM is shared by the module's tests


# ---------------------------------------------------------------------------------------------- parity
@vllm_test
def test_rollout_logprobs_match_the_policy_forward(engine, policy, requests_):
    """vLLM's per-token log-probs of its own completions equal the policy's teacher-forced forward on the Rollout the
    shared ``generate`` built (its prompt encoding included), and the Rollout is the hf engine's shape."""
    model, processor = policy
    sampling = Sampling(temperature=1.0, max_new_tokens=40, min_new_tokens=40)
    ro = engine.generate(model, processor, requests_, sampling)
    assert ro.completion_ids.shape == (12, 40)
    assert (ro.completion_mask.sum(1) == 40).all(), "min_new_tokens = max_new_tokens: no row may stop early"
    assert ro.group_ids.tolist() == [0] * 6 + [1] * 6
    upd = HFUpdateEngine(micro_batch_size=12, temperature=1.0)
    logp = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu")))
    diff = (logp - engine.last_logprobs).abs()[ro.completion_mask.bool()].max().item()
    print(f"[{engine.mode}] rollout log-prob |vLLM - policy| max {diff:.3g}")
    assert diff < SYNC_ATOL

    hf = build_rollout_engine("hf").generate(model, processor, requests_, Sampling(max_new_tokens=2))
    assert torch.equal(ro.prompt_ids, hf.prompt_ids) and torch.equal(ro.prompt_mask, hf.prompt_mask)
    assert torch.equal(ro.pixel_values, hf.pixel_values) and torch.equal(ro.image_grid_thw, hf.image_grid_thw)
    assert torch.equal(ro.prompt_mm_types, hf.prompt_mm_types)


@vllm_test
def test_greedy_completions_equal_the_hf_engine(engine, policy, requests_):
    model, processor = policy
    greedy = Sampling(max_new_tokens=64, greedy=True)
    reqs = [RolloutRequest(r.prompt, r.image, 1, r.group_id) for r in requests_]
    ours = engine.generate(model, processor, reqs, greedy)
    ref = build_rollout_engine("hf").generate(model, processor, reqs, greedy)
    assert ours.texts == ref.texts
    assert torch.equal(ours.completion_mask, ref.completion_mask)


def _uncertain_prompt(model, processor, request, temperature: float = 0.7):
    """A prompt whose next token is uncertain but not flat: the request's prompt followed by the greedy completion up
    to its first position with 0.2 < max p < 0.8 at ``temperature`` (a number of the box). Returns the prompt and
    the policy's exact next-token distribution there [V]."""
    hf = build_rollout_engine("hf")
    greedy = hf.generate(
        model,
        processor,
        [RolloutRequest(request.prompt, request.image, 1, 0)],
        Sampling(max_new_tokens=48, greedy=True),
    )
    ids = greedy.completion_ids[0]
    with torch.no_grad():
        logits = model(**greedy.rows([0]), logits_to_keep=ids.shape[0] + 1).logits[0, :-1]  # position t -> token t
    probs = torch.softmax(logits.double() / temperature, -1)
    t = next((t for t in range(ids.shape[0]) if 0.2 < probs[t].max() < 0.8), None)
    assert t is not None, "no moderately uncertain position in the toy model's greedy completion"
    prompt = request.prompt + processor.tokenizer.decode(ids[:t])
    # the exact distribution of the first token after that prompt, as the processor encodes it
    first = hf.generate(
        model, processor, [RolloutRequest(prompt, request.image, 1, 0)], Sampling(max_new_tokens=1, greedy=True)
    )
    with torch.no_grad():
        logits = model(**first.rows([0]), logits_to_keep=2).logits[0, 0]
    return prompt, torch.softmax(logits.double() / temperature, -1)


def _chi2_999(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _bins(p: torch.Tensor, min_p: float = 0.01) -> list[list[int]]:
    """One bin per token of probability >= min_p, the rest pooled (so every expected count is large enough)."""
    big = torch.nonzero(p >= min_p).flatten().tolist()
    rest = torch.nonzero(p < min_p).flatten().tolist()
    return [[t] for t in big] + [rest]


@vllm_test
def test_sampling_distribution_matches_the_hf_engine(engine, policy, requests_):
    """After a prompt whose next token is uncertain (a number of a box), the first token each engine samples follows
    the policy's exact distribution at temperature 0.7 (chi-square goodness of fit at p = 0.001) and the two engines'
    samples each other (chi-square homogeneity). The test has power (measured while writing it, 12 bins, limit 31.4):
    vLLM's statistic is 9.3 at 0.7, 48 when it samples at 0.8 instead and 118 at 1.0."""
    model, processor = policy
    req = requests_[0]
    prompt, p = _uncertain_prompt(model, processor, req)
    n = 600
    sampling = Sampling(temperature=0.7, max_new_tokens=1)
    bins = _bins(p)
    expected = torch.stack([p[b].sum() for b in bins])
    observed = {}
    for name, eng in (("vllm", engine), ("hf", build_rollout_engine("hf"))):
        torch.manual_seed(0)
        ro = eng.generate(model, processor, [RolloutRequest(prompt, req.image, n, 0)], sampling)
        counts = torch.bincount(ro.completion_ids[:, 0], minlength=p.shape[0]).double()
        observed[name] = torch.stack([counts[b].sum() for b in bins])
    limit = _chi2_999(len(bins) - 1)
    fit = {k: float(((o - n * expected) ** 2 / (n * expected)).sum()) for k, o in observed.items()}
    both = torch.stack([observed["vllm"], observed["hf"]])  # [2, bins]
    e2 = both.sum(1, keepdim=True) * both.sum(0, keepdim=True) / both.sum()
    keep = e2.min(0).values > 0
    homog = float(((both - e2)[:, keep] ** 2 / e2[:, keep]).sum())
    print(
        f"[{engine.mode}] {len(bins)} bins, max p {p.max():.3f}: chi2 vllm {fit['vllm']:.1f}, hf {fit['hf']:.1f}, "
        f"vllm vs hf {homog:.1f}; 0.999 quantile {limit:.1f}"
    )
    assert len(bins) >= 4
    assert fit["vllm"] < limit and fit["hf"] < limit and homog < _chi2_999(int(keep.sum()) - 1)


@vllm_test
def test_suppressed_ids_are_never_sampled(engine, policy, requests_):
    """The modal first token of the completion, suppressed, never appears (and EOS stays allowed)."""
    model, processor = policy
    req = requests_[0]
    first = build_rollout_engine("hf").generate(
        model, processor, [RolloutRequest(req.prompt, req.image, 1, 0)], Sampling(max_new_tokens=1, greedy=True)
    )
    modal = int(first.completion_ids[0, 0])
    ids, _ = engine.sample(
        model,
        processor,
        [req.prompt],
        [req.image],
        group_size=24,
        sampling=Sampling(temperature=1.0, max_new_tokens=4),
        suppress_ids=[modal],
        eos_ids=[processor.tokenizer.eos_token_id],
    )
    assert ids.shape[0] == 24 and not (ids == modal).any()


# ---------------------------------------------------------------------------------------------- weight sync
def _one_optimizer_step(model, processor, ro) -> None:
    """One AdamW step (tiny.yaml's lr 2e-5) on a policy-gradient-shaped loss of the rollout: the real kind of update."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0)
    model.train()
    upd = HFUpdateEngine(micro_batch_size=12)
    m = ro.completion_mask
    adv = torch.linspace(-1, 1, m.shape[0])[:, None]
    upd.backward(
        model,
        upd.prepare(model, processor, ro, torch.device("cpu")),
        lambda logp, ent, rows: -(adv[rows] * logp * m[rows]).sum() / m.sum(),
    )
    opt.step()
    model.eval()


@vllm_test
def test_weight_sync_matches_and_stale_weights_fail(engine, policy, requests_):
    model, processor = copy.deepcopy(policy[0]), policy[1]
    ro = engine.generate(model, processor, requests_, Sampling(max_new_tokens=32))  # first use: pushes the weights
    first = engine.backend(model).syncs[-1]
    assert first["max_abs_logp_diff"] is not None and first["max_abs_logp_diff"] < SYNC_ATOL

    _one_optimizer_step(model, processor, ro)
    stale = [engine.weights_logp_diff(model) for _ in range(3)]  # vLLM still holds the weights of one step earlier
    with pytest.raises(RuntimeError, match="do not match the policy"):
        engine.check_weights(model)

    engine.on_weights_updated(model)  # what GRPOModule calls after the optimizer step
    synced = engine.backend(model).syncs[-1]
    after = [engine.weights_logp_diff(model) for _ in range(3)]
    print(
        f"[{engine.mode}] |dlogp| after sync {[f'{x:.2g}' for x in after]} (push {synced['seconds'] * 1e3:.0f} ms, "
        f"check {synced['max_abs_logp_diff']:.2g}); one step stale {[f'{x:.2g}' for x in stale]}"
    )
    assert synced["max_abs_logp_diff"] < SYNC_ATOL and max(after) < SYNC_ATOL
    assert min(stale) > SYNC_ATOL, "the weights of one step earlier must fail the check"
    assert min(stale) > 10 * max(after)


# ---------------------------------------------------------------------------------------------- video clips
VIDEO = REPO / "checkpoints/toy-qwen2.5-vl-cycle-video"
"""The video checkpoint: the same config, processor and tokenizer as TOY, so the vLLM started from TOY (colocated or
the server) samples it once the engine has pushed its weights (every sample pushes when the policy changes)."""


@pytest.fixture(scope="module")
def video_policy():
    from lightning_modules.models.loading import load_policy

    model, processor = load_policy(str(VIDEO), dtype="fp32")
    return model.eval(), processor


def _clip_requests(processor, n: int = 1, clips: int = 4) -> list[RolloutRequest]:
    """CycleGRPO's grounding prompt of the temporal clips (toy_temporal) on held-out toy clips: 16 frames at 2 fps, so
    the clip's t axis (8 patches x 4 tokens per second) runs far past its 4 x 4 grid."""
    from core.video import VideoClip
    from datamodules.toy_video import make_clip
    from lightning_modules.models.prompts import build_prompt_text

    out = []
    for i in range(clips):
        c = make_clip("test", i, 0)
        prompt = build_prompt_text(processor, c["meta"]["query"], task="rec", template="toy_temporal", video=True)
        out.append(RolloutRequest(prompt, VideoClip(c["frames"], fps=c["fps"]), n, i))
    return out


@vllm_test
def test_clip_positions_are_the_full_forwards():
    """vLLM's own Qwen2.5-VL puts the text after a 16-frame clip 25 positions further than transformers' forward
    (max(t) + 1 = start + 29 instead of start + max(h, w) = start + 4, on all three axes); the class the engine runs
    (`vllm_qwen`) gives a prompt's positions and its completion's exactly as transformers' get_rope_index of prompt +
    completion does."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    from lightning_modules.engines.vllm_qwen import Qwen2_5_VLWithProjectPositions
    from lightning_modules.models.loading import load_policy
    from lightning_modules.models.qwen_vl import processor_inputs

    model, processor = load_policy(str(VIDEO), dtype="fp32")
    req = _clip_requests(processor, clips=1)[0]
    enc = processor_inputs(processor, [req.prompt], [req.image])
    ids = enc["input_ids"][0].tolist()
    grid, seconds = enc["video_grid_thw"][0], enc["second_per_grid_ts"][0]
    assert grid.tolist() == [8, 8, 8] and float(seconds) == 1.0
    start = ids.index(model.config.video_token_id)
    feature = SimpleNamespace(
        modality="video",
        mm_position=SimpleNamespace(offset=start, length=int(grid.prod()) // 4),
        data={"video_grid_thw": SimpleNamespace(data=grid), "second_per_grid_ts": SimpleNamespace(data=seconds)},
    )
    ours = object.__new__(Qwen2_5_VLWithProjectPositions)  # the methods read only .config
    object.__setattr__(ours, "config", model.config)
    theirs_pos, theirs_delta = Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions(ours, ids, [feature])
    ours_pos, ours_delta = ours.get_mrope_input_positions(ids, [feature])

    T = 5  # a completion of 5 tokens: a full forward's positions of prompt + completion
    full_ids = torch.cat([enc["input_ids"], torch.full((1, T), 11)], 1)
    full, _ = model.model.get_rope_index(
        full_ids,
        mm_token_type_ids=torch.cat([enc["mm_token_type_ids"], torch.zeros(1, T, dtype=torch.long)], 1),
        video_grid_thw=enc["video_grid_thw"],
        second_per_grid_ts=enc["second_per_grid_ts"],
        attention_mask=torch.ones_like(full_ids),
    )
    P = len(ids)
    assert torch.equal(torch.as_tensor(ours_pos), full[:, 0, :P])
    completion = [P + k + ours_delta for k in range(T)]  # vLLM's decode positions: index + delta
    assert full[:, 0, P:].tolist() == [completion] * 3
    end = start + int(grid.prod()) // 4  # the first text token after the clip
    diff = torch.as_tensor(theirs_pos) - full[:, 0, :P]
    shift = theirs_delta - ours_delta
    print(f"vLLM's own positions after the clip (index {end} on): +{diff[:, end].tolist()}; decode +{shift}")
    assert not diff[:, :end].any() and (diff[:, end:] == 25).all() and shift == 25


@vllm_test
def test_greedy_clip_rollouts_equal_the_hf_engine(engine, video_policy):
    """The toy video checkpoint's greedy groundings of 4 held-out clips: vLLM's equal the hf engine's token for token,
    from the same prompt encoding (prompt ids, pixels, grids, seconds per temporal patch)."""
    model, processor = video_policy
    reqs = _clip_requests(processor)
    greedy = Sampling(max_new_tokens=48, greedy=True)
    ours = engine.generate(model, processor, reqs, greedy)
    ref = build_rollout_engine("hf").generate(model, processor, reqs, greedy)
    print(f"[{engine.mode}] clip groundings: vllm {ours.texts} hf {ref.texts}")
    assert ours.is_video and ref.is_video
    assert torch.equal(ours.prompt_ids, ref.prompt_ids) and torch.equal(ours.prompt_mask, ref.prompt_mask)
    assert torch.equal(ours.pixel_values, ref.pixel_values) and torch.equal(ours.image_grid_thw, ref.image_grid_thw)
    assert torch.equal(ours.second_per_grid_ts, ref.second_per_grid_ts)
    assert ours.texts == ref.texts and all("</answer>" in t for t in ours.texts)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    # the weight push before this rollout was checked on a clip prompt (the last one sampled)
    sync = engine.backend(model).syncs[-1]
    assert sync["max_abs_logp_diff"] is not None and sync["max_abs_logp_diff"] < SYNC_ATOL


@vllm_test
def test_clip_rollout_logprobs_match_the_policy_forward(engine, video_policy):
    """vLLM's log-probs of its sampled clip completions (temperature 1) equal the policy's teacher-forced forward on
    the Rollout (transformers' positions after the clip): the update scores what vLLM sampled."""
    model, processor = video_policy
    reqs = _clip_requests(processor, n=3, clips=2)
    ro = engine.generate(model, processor, reqs, Sampling(temperature=1.0, max_new_tokens=24, min_new_tokens=24))
    assert ro.completion_ids.shape == (6, 24) and (ro.completion_mask.sum(1) == 24).all()
    upd = HFUpdateEngine(micro_batch_size=6, temperature=1.0)
    logp = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu")))
    diff = (logp - engine.last_logprobs).abs()[ro.completion_mask.bool()].max().item()
    print(f"[{engine.mode}] clip rollout log-prob |vLLM - policy| max {diff:.3g}")
    assert diff < SYNC_ATOL


def test_clips_are_refused_where_vllm_would_place_them_elsewhere(policy):
    """A vLLM whose model is neither Qwen2.5-VL (the project's positions after a clip) nor Qwen3-VL (vLLM's own, as
    transformers') refuses clips, saying why (no vLLM needed: the engine's backend is a stand-in that would fail if
    sampled)."""
    from types import SimpleNamespace

    from core.video import VideoClip
    from lightning_modules.engines.vllm import _Backend
    from lightning_modules.engines.vllm_backend import UnsupportedClipError, weights_fingerprint

    model, processor = policy
    eng = build_rollout_engine("vllm")
    impl = SimpleNamespace(takes_clips=False, architecture="Qwen2VLForConditionalGeneration")
    eng._backend = _Backend(("stand-in",), impl, torch.float32, fingerprint=weights_fingerprint(model))
    with pytest.raises(
        UnsupportedClipError, match="Qwen2.5-VL and Qwen3-VL checkpoints only.*max\\(positions\\) \\+ 1"
    ):
        eng.sample(
            model,
            processor,
            ["<|vision_start|><|video_pad|><|vision_end|>when"],
            [VideoClip([_scene("red", 20)] * 4, fps=2.0)],
            group_size=1,
            sampling=Sampling(max_new_tokens=2),
            suppress_ids=[],
            eos_ids=[processor.tokenizer.eos_token_id],
        )


@pytest.fixture(scope="module")
def qwen3_policy(tmp_path_factory):
    """A random tiny Qwen3-VL (configs/cycle_4b_temporal.yaml's architecture) with the toy tokenizer; heads of 32
    (vLLM's CPU attention has no kernel for 16)."""
    from lightning_modules.models.loading import load_policy
    from lightning_modules.models.tiny_model import build_tiny_qwen3_vl

    path = build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), TOY, image_size=112, head_dim=32)
    model, processor = load_policy(str(path), dtype="fp32")
    return model.eval(), processor


@vllm_test
def test_qwen3_vl_clips_sample_from_the_prompt_and_positions_the_update_scores(qwen3_policy):
    """Qwen3-VL clips through vLLM (colocated, vLLM's own Qwen3-VL): the prompt vLLM tokenised is the processor's
    (timestamped blocks, each clip at its size on the 32-px grid under the whole-clip budget), greedy completions
    equal the hf engine's, and the log-probs of sampled completions equal the policy's teacher-forced forward (so
    vLLM placed the blocks and the text after them where transformers does)."""
    model, processor = qwen3_policy
    # its own vLLM beside the module's toy one (an engine with options does not share a running vLLM; one without
    # shares the one started from its policy's directory); stopped with the others at the end of the module
    eng = build_rollout_engine("vllm", model_path=model.name_or_path)
    reqs = _clip_requests(processor, clips=2)
    greedy = Sampling(max_new_tokens=12, greedy=True)
    ours = eng.generate(model, processor, reqs, greedy)
    ref = build_rollout_engine("hf").generate(model, processor, reqs, greedy)
    assert ours.is_video and ours.image_grid_thw.tolist() == [[8, 8, 8]] * 2
    assert torch.equal(ours.prompt_ids, ref.prompt_ids) and torch.equal(ours.pixel_values, ref.pixel_values)
    assert torch.equal(ours.completion_ids, ref.completion_ids), (ours.completion_ids, ref.completion_ids)
    ro = eng.generate(
        model,
        processor,
        _clip_requests(processor, n=3, clips=2),
        Sampling(temperature=1.0, max_new_tokens=12, min_new_tokens=12),
    )
    upd = HFUpdateEngine(micro_batch_size=6, temperature=1.0)
    logp = upd.logprobs(model, upd.prepare(model, processor, ro, torch.device("cpu")))
    diff = (logp - eng.last_logprobs).abs()[ro.completion_mask.bool()].max().item()
    print(f"Qwen3-VL clip rollout log-prob |vLLM - policy| max {diff:.3g}")
    assert diff < SYNC_ATOL


# ---------------------------------------------------------------------------------------------- fits
def _tiny_fit_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(REPO / "configs/tiny.yaml"),
        "--model.init_args.engines.rollout_engine",
        "vllm",
        "--model.init_args.policy.model_name_or_path",
        str(TOY),
        "--model.init_args.sampling.max_new_tokens",
        "32",
        "--model.init_args.sampling.group_size",
        "3",
        "--model.init_args.engines.micro_batch_size",
        "6",
        "--data.init_args.data_root",
        str(tmp_path / "toy"),
        "--data.init_args.toy",
        "{splits: {train: 4, val: 2, ood: 2}, seed: 0}",
        "--data.init_args.batch_size",
        "2",
        "--data.init_args.eval_batch_size",
        "2",
        "--data.init_args.max_eval_samples",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.logger",
        "false",
        "--callbacks",
        "{}",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        *extra,
    ]


@vllm_test
def test_tiny_fit_colocate(tmp_path, monkeypatch):
    """train.py fit on configs/tiny.yaml with the colocated vLLM: each optimizer step pushes the weights and the
    check passes (a failed check raises and ends the fit)."""
    from lightning_modules.engines.vllm import VLLMRolloutEngine
    from train import cli_main

    monkeypatch.chdir(tmp_path)
    cli = cli_main(_tiny_fit_args(tmp_path))
    assert cli.trainer.global_step == 2
    eng = cli.model.rollout_engine
    assert isinstance(eng, VLLMRolloutEngine) and eng.mode == "colocate"
    checks = [s["max_abs_logp_diff"] for s in eng.backend(cli.model.policy).syncs[-3:]]
    print(f"[colocate fit] checks after the first push and the 2 steps: {checks}")
    assert len(checks) == 3 and all(c is not None and c < SYNC_ATOL for c in checks)
    assert any(k.startswith("val/") for k in cli.trainer.callback_metrics)


@vllm_test
def test_tiny_fit_server(server, tmp_path):
    """python train.py fit (a subprocess) against the vLLM server: the weights reach the server through weights_dir,
    once at the first rollout and after each of the 2 optimizer steps (version 3), each push checked."""
    import httpx

    weights = tmp_path / "weights"
    args = {"mode": "server", "url": server, "weights_dir": str(weights)}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline")
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            *_tiny_fit_args(tmp_path, "--model.init_args.engines.rollout_args", json.dumps(args)),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "run/checkpoints").exists() or any((tmp_path / "run").rglob("*.ckpt"))
    health = httpx.get(f"{server}/health").json()
    assert [p.name for p in weights.glob("step-*")] == ["step-0000003"]
    assert health["weights"] == str((weights / "step-0000003").resolve())


@vllm_test
def test_tiny_fit_server_two_ranks(server, tmp_path):
    """Two trainer processes (DDP, gloo) against one server: rank 0 pushes, the other waits at a barrier, and both
    ranks' checks pass (each compares the server with its own copy of the weights)."""
    import httpx

    weights = tmp_path / "weights"
    args = {"mode": "server", "url": server, "weights_dir": str(weights)}
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="offline")
    ddp = ["--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            *_tiny_fit_args(tmp_path, "--model.init_args.engines.rollout_args", json.dumps(args), *ddp),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [p.name for p in weights.glob("step-*")] == ["step-0000003"]  # the first push and one per step, by rank 0
    assert httpx.get(f"{server}/health").json()["weights"] == str((weights / "step-0000003").resolve())


@vllm_test
def test_vllm_overlay_on_the_gpu_config_runs_on_cpu(tmp_path, monkeypatch):
    """configs/overlays/vllm.yaml on the one-GPU paper config, with the toy model swapped in exactly as
    tests/cli/test_config_runs.py swaps every config (bf16-true kept): fit steps run and the pushes pass the overlay's
    bf16 tolerance."""
    import yaml

    from tests.cli.test_config_runs import CONFIGS, compose, cpu_swap
    from train import cli_main

    base, overlay = CONFIGS / "rec_3b_1gpu.yaml", CONFIGS / "overlays/vllm.yaml"
    composed = compose((base, overlay))
    plain = compose((base,))
    m, p = composed["model"]["init_args"], plain["model"]["init_args"]
    assert {k for k in set(m) | set(p) if m.get(k) != p.get(k)} == {"engines"}
    m, p = m["engines"], p["engines"]
    changed = {k for k in set(m) | set(p) if m.get(k) != p.get(k)}
    assert changed == {"rollout_engine", "rollout_args"}, changed  # switching engines changes nothing else

    from datamodules.toy import export_jsonl

    root = tmp_path / "toy"
    export_jsonl(root, "train", 8, seed=0, task="rec")
    export_jsonl(root, "val", 4, seed=0, task="rec")
    cfg = cpu_swap(composed, {"rec": root}, tmp_path)
    cfg["trainer"]["max_epochs"] = 1
    for name in ("synthesis", "completions", "results"):  # the data server is not what this test is about
        cfg["callbacks"].pop(name, None)
    cfg["trainer"]["logger"] = False
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    cli = cli_main(["fit", "--config", str(path)])
    assert cli.trainer.global_step >= 2
    eng = cli.model.rollout_engine
    syncs = eng.backend(cli.model.policy).syncs
    print(f"[overlay, bf16] checks: {[s['max_abs_logp_diff'] for s in syncs]}")
    assert all(s["max_abs_logp_diff"] is None or s["max_abs_logp_diff"] < eng.sync_atol for s in syncs)
