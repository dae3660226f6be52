"""GRPOModule end to end on CPU: rollout -> rewards -> advantages -> loss -> optimizer, checkpoint and resume."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_modules.grpo.outputs import StepOutput
from train import cli_main

REPO = Path(__file__).resolve().parents[2]


def _args(tiny_model_dir: Path, data_root: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--config",
        str(REPO / "configs/tiny.yaml"),
        "--model.init_args.policy.model_name_or_path",
        str(tiny_model_dir),
        "--model.init_args.sampling.max_new_tokens",
        "12",
        "--model.init_args.sampling.group_size",
        "3",
        "--model.init_args.engines.micro_batch_size",
        "4",
        "--data.init_args.data_root",
        str(data_root),
        "--data.init_args.toy",
        "null",
        "--data.init_args.train_files",
        "[train.jsonl]",
        "--data.init_args.val_files",
        "{rec_val: val.jsonl}",
        "--data.init_args.batch_size",
        "2",
        "--trainer.default_root_dir",
        str(out),
        "--trainer.logger",
        "false",
        "--trainer.callbacks",
        "[]",
        "--callbacks",  # none of tiny.yaml's named callbacks
        "{}",
        "--trainer.enable_checkpointing",
        "true",
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


class _Outputs(L.Callback):
    """What each training step returned (the completions callbacks receive)."""

    def __init__(self):
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


def _fit_recording(args: list[str]):
    """``train.py fit`` in-process with an `_Outputs` recorder; returns (cli, the last step's completions)."""
    cli = cli_main(list(args), run=False)
    rec = _Outputs()
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli, StepOutput.of(rec.outputs[-1]).completions


def test_fit_runs_grpo_steps_and_resumes_with_smoother_state(tiny_model_dir, rec_dir, tmp_path):
    out = tmp_path / "run"
    cli = cli_main(
        ["fit", *_args(tiny_model_dir, rec_dir, out, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0")]
    )
    model = cli.model
    assert cli.trainer.global_step == 2
    assert model.smoother.steps == 2  # two batches went through the EMA
    logged = cli.trainer.logged_metrics
    for key in (
        "train/reward/total",
        "train/reward/accuracy",
        "train/reward/format",
        "train/reward/diversity",
        "train/entropy",
        "train/diversity/gt",
        "train/diversity/smoothed",
        "train/diversity/global_avg",
        "train/zero_variance_frac",
        "train/kl",
        "train/clip_frac_low",
        "train/clip_frac_high",
        "train/iou",
        "train/acc50",
        "train/all_correct_frac",
        "train/all_wrong_frac",
    ):
        assert key in logged, key
        assert torch.isfinite(torch.as_tensor(logged[key])), key
    ckpts = sorted(out.rglob("*.ckpt"))
    assert ckpts, "fit wrote no checkpoint"
    ckpt = torch.load(ckpts[-1], weights_only=False)
    assert ckpt["diversity_smoother"]["steps"] == 2
    assert not any(k.startswith("_ref") for k in ckpt["state_dict"]), "the frozen reference must not be saved"

    # resume: the smoother continues from its saved state, one more step
    cli2 = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path / "run2",
                "--trainer.max_steps",
                "3",
                "--trainer.limit_val_batches",
                "0",
            ),
            "--ckpt_path",
            str(ckpts[-1]),
        ]
    )
    assert cli2.trainer.global_step == 3
    sm, saved = cli2.model.smoother, ckpt["diversity_smoother"]
    assert sm.steps == 3
    # the third step's moving average continues the saved one (a fresh smoother would restart from batch_avg)
    if sm.batch_avg <= sm.eps:  # an uninformative batch leaves the average alone
        expected = saved["global_avg"]
    elif saved["global_avg"] is None:
        expected = sm.batch_avg
    else:
        expected = sm.beta * saved["global_avg"] + (1 - sm.beta) * sm.batch_avg
    assert sm.global_avg == pytest.approx(expected)

    # a checkpoint of the flat arguments (before the typed groups) resumes too: its hyperparameters are read through
    # cli.flat_flags, so the method and its EMA come back as they were trained
    from cli.flat_flags import MOVED, flat_hparams

    hp = ckpt["hyper_parameters"]
    flat = {k: v for k, v in flat_hparams(hp).items() if k in MOVED or k in ("_class_path", "task")}
    flat.update(method="syn_grpo", method_args=None, diversity_beta=0.5)
    assert not {"policy", "sampling", "kl", "engines", "optimisation"} & set(flat)
    torch.save({**ckpt, "hyper_parameters": flat}, tmp_path / "flat.ckpt")
    cli3 = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path / "run3",
                "--trainer.max_steps",
                "3",
                "--trainer.limit_val_batches",
                "0",
            ),
            "--ckpt_path",
            str(tmp_path / "flat.ckpt"),
        ]
    )
    assert cli3.trainer.global_step == 3 and cli3.model.smoother.steps == 3
    assert type(cli3.model.method).__name__ == "SynGRPO" and cli3.model.method.diversity_beta == 0.5


def test_policy_changes_and_reference_stays(tiny_model_dir, rec_dir, tmp_path):
    # A random model earns zero reward everywhere, so every group has zero advantage and GRPO alone gives no
    # gradient; the entropy bonus ("GRPO + Entropy Loss" baseline) does, which exercises the same backward path.
    cli = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path,
                "--trainer.max_steps",
                "1",
                "--trainer.limit_val_batches",
                "0",
                "--model.init_args.optimisation.entropy_coef",
                "0.1",
                "--model.init_args.optimizer.init_args.lr",
                "1e-2",
            ),
        ]
    )
    model = cli.model
    ref = model.reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    diffs = [(p - q).abs().max().item() for p, q in zip(model.policy.parameters(), ref.parameters())]
    assert max(diffs) > 0, "the optimizer step did not change the policy"


def test_no_reference_when_kl_is_zero(tiny_model_dir, rec_dir, tmp_path):
    cli = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path,
                "--trainer.max_steps",
                "1",
                "--trainer.limit_val_batches",
                "0",
                "--model.init_args.kl.coef",
                "0.0",
            ),
        ]
    )
    assert cli.model.reference is None


def test_validate_logs_named_sets(tiny_model_dir, rec_dir, tmp_path):
    cli = cli_main(["validate", *_args(tiny_model_dir, rec_dir, tmp_path)])
    metrics = cli.trainer.callback_metrics
    assert "val/rec_val/acc50" in metrics and "val/rec_val/miou" in metrics
    assert 0.0 <= float(metrics["val/rec_val/acc50"]) <= 1.0


def test_bad_group_size_names_the_flag(tiny_model_dir):
    from lightning_modules.grpo import GRPOModule

    with pytest.raises(ValueError, match="--model.sampling.group_size"):
        GRPOModule(policy={"model_name_or_path": str(tiny_model_dir)}, sampling={"group_size": 1})


def test_packed_update_engine_matches_the_hf_forward(tiny_model_dir, rec_dir, tmp_path):
    """The efficient update path (vision once per image, packed micro-batches) takes the same optimizer step."""
    results = {}
    for engine in ("hf", "packed"):
        cli, texts = _fit_recording(
            _args(
                tiny_model_dir,
                rec_dir,
                tmp_path / engine,
                "--trainer.max_steps",
                "1",
                "--trainer.limit_val_batches",
                "0",
                "--model.init_args.optimisation.entropy_coef",
                "0.1",
                "--model.init_args.engines.update_engine",
                engine,
                "--model.init_args.kl.coef",
                "0.0",
                "--model.init_args.optimizer.class_path",
                "torch.optim.SGD",
                "--model.init_args.optimizer.init_args.lr",
                "1.0",
            )
        )
        results[engine] = (cli.model.policy.state_dict(), dict(cli.trainer.logged_metrics), texts)
    (p_hf, m_hf, t_hf), (p_pk, m_pk, t_pk) = results["hf"], results["packed"]
    assert t_hf == t_pk  # same seed, same rollout
    assert float(m_hf["train/entropy"]) == pytest.approx(float(m_pk["train/entropy"]), rel=1e-4)
    for k in p_hf:
        torch.testing.assert_close(p_hf[k], p_pk[k], rtol=1e-3, atol=1e-5, msg=k)


def test_fast_rollout_engine_runs_a_grpo_step(tiny_model_dir, rec_dir, tmp_path):
    cli, texts = _fit_recording(
        _args(
            tiny_model_dir,
            rec_dir,
            tmp_path,
            "--trainer.max_steps",
            "1",
            "--trainer.limit_val_batches",
            "0",
            "--model.init_args.engines.rollout_engine",
            "fast",
        )
    )
    assert cli.trainer.global_step == 1 and len(texts) == 6


@pytest.mark.parametrize("engine", ["hf", "packed"])
def test_entropy_adv_baseline_step(tiny_model_dir, rec_dir, tmp_path, engine):
    cli = cli_main(
        [
            "fit",
            *_args(
                tiny_model_dir,
                rec_dir,
                tmp_path,
                "--trainer.max_steps",
                "1",
                "--trainer.limit_val_batches",
                "0",
                "--model.init_args.optimisation.entropy_adv_coef",
                "0.4",
                "--model.init_args.engines.update_engine",
                engine,
            ),
        ]
    )
    assert torch.isfinite(torch.as_tensor(cli.trainer.logged_metrics["train/pg_loss"]))


def test_baseline_is_scored_in_its_own_answer_format(tmp_path, monkeypatch):
    """A GRPO baseline answers in VLM-R1's think + answer format: its validation format rate counts that format
    (it read 0 when every method was scored by Syn-GRPO's four-part format)."""
    monkeypatch.chdir(tmp_path)
    cli = cli_main(
        [
            "validate",
            "--config",
            str(REPO / "configs/tiny.yaml"),
            "--config",
            str(REPO / "configs/baselines/grpo.yaml"),
            "--model.init_args.policy.model_name_or_path",
            str(REPO / "checkpoints/toy-qwen2.5-vl"),
            "--data.init_args.data_root",
            str(tmp_path / "toy"),
            "--data.init_args.toy.splits",
            "{train: 4, val: 8, ood: 4}",
            "--data.init_args.max_eval_samples",
            "8",
            "--data.init_args.eval_batch_size",
            "8",
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            "[]",
            "--trainer.enable_progress_bar",
            "false",
        ]
    )
    fmt = float(cli.trainer.callback_metrics["val/toy_val/format"])
    assert cli.model.method.format == cli.model.eval_format == "think_answer"
    assert fmt > 0.5, fmt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_step_with_the_one_gpu_configs_engines_and_precision(tiny_model_dir, rec_dir, tmp_path):
    """The 1gpu configs' path at tiny scale: bf16 compute with fp32 masters, fast rollout with CUDA graphs, packed
    update; the masters move at the paper's lr and the step logs its phases and peak memory."""
    cli, texts = _fit_recording(
        _args(
            tiny_model_dir,
            rec_dir,
            tmp_path,
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.accelerator",
            "gpu",
            "--trainer.precision",
            "bf16-true",
            "--model.init_args.policy.dtype",
            "bf16",
            "--model.init_args.engines.rollout_engine",
            "fast",
            "--model.init_args.engines.update_engine",
            "packed",
            "--model.init_args.optimizer.init_args.lr",
            "1e-6",
        )
    )
    logged = cli.trainer.logged_metrics
    assert cli.trainer.global_step == 2 and len(texts) == 6
    assert float(logged["train/peak_mem_gib"]) > 0 and float(logged["train/time/rollout_s"]) > 0
    opt = cli.model.optimizers()
    opt = getattr(opt, "optimizer", opt)  # Lightning's wrapper -> MasterWeightOptimizer
    assert opt._low and all(p.dtype == torch.bfloat16 and m.dtype == torch.float32 for p, m in opt._low)
