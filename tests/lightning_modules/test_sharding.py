"""FSDP2 on one process (gloo, world size 1): the sharded policy generates and scores exactly as the plain one."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from lightning_modules.engines import decode
from lightning_modules.engines.base import build_rollout_engine, rollout
from lightning_modules.engines.hf import completion_logps
from lightning_modules.models import fsdp
from lightning_modules.models.loading import load_policy


@pytest.fixture
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:  # a free port: other test runs may share the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("engine", "gather"), [("hf", "once"), ("fast", "once"), ("hf", "per_layer"), ("hf_shared", "per_layer")]
)
def test_gathered_rollout_and_logprobs_match_the_unsharded_policy(mesh, tiny_model_dir, engine, gather):
    """``once``: the whole policy gathered for the rollout; ``per_layer``: the root only, each layer gathered by its
    own forward at every decode step."""
    from PIL import Image

    model, processor = load_policy(str(tiny_model_dir), dtype="fp32")
    sharded = fsdp.shard(copy.deepcopy(model), mesh, compute_dtype=torch.float32)
    assert fsdp.is_sharded(sharded) and all(fsdp.is_sharded(u) for u in fsdp.shard_units(sharded))
    images = [Image.new("RGB", (112, 112), c) for c in ("red", "blue")]
    kwargs = dict(group_size=2, template="toy", max_new_tokens=6, do_sample=False, engine=engine)
    want = rollout(model, processor, images, ["the red square", "the blue square"], **kwargs)
    release = build_rollout_engine(engine).release  # what GRPOModule hands `gathered`
    with fsdp.gathered(sharded, layers=gather == "once", release=release):
        got = rollout(sharded, processor, images, ["the red square", "the blue square"], **kwargs)
        cached = sharded in decode._ENGINES
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert cached == (engine == "fast") and sharded not in decode._ENGINES  # the decode step went with the gather
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in sharded.parameters())  # the shards are back after the rollout
    inputs = want.rows(slice(None))
    lp_want = completion_logps(model, inputs, want.completion_ids, want.completion_mask)[0]
    lp_got = completion_logps(sharded, inputs, want.completion_ids, want.completion_mask)[0]  # a gather per layer
    torch.testing.assert_close(lp_got, lp_want, rtol=1e-5, atol=1e-5)


def test_per_layer_rollouts_need_the_hf_engine():
    from lightning_modules.grpo import GRPOModule

    with pytest.raises(ValueError, match="rollout_engine hf"):
        GRPOModule(engines={"rollout_engine": "fast", "rollout_gather": "per_layer"})


def test_shard_refuses_a_model_without_decoder_layers(mesh):
    with pytest.raises(ValueError, match="ddp or on one GPU"):
        fsdp.shard(torch.nn.Linear(4, 4), mesh, compute_dtype=torch.float32)


@pytest.mark.parametrize(
    ("strategy", "devices", "precision", "match"),
    [
        ("fsdp2", 1, "bf16-true", "--trainer.precision 32-true"),  # would cast the fp32 master shards
        ("model_parallel", 2, "32-true", "no tensor parallelism"),  # its defaults: the node's GPUs as one TP group
    ],
)
def test_strategy_misuse_gets_a_clear_error(strategy, devices, precision, match):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_modules.grpo import GRPOModule
    from lightning_modules.grpo.checks import check_strategy

    module = GRPOModule(policy={"model_name_or_path": "unused"})  # __init__ loads nothing
    strategy = ModelParallelStrategy() if strategy == "model_parallel" else strategy
    module.trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, logger=False)
    with pytest.raises(ValueError, match=match):
        check_strategy(module.trainer, module.rollout_engine, module.update_engine)


def test_fsdp2_refuses_the_packed_update_engine():
    """The packed engine calls the vision tower directly: under FSDP2 the root unit's patch embedding is still a
    sharded DTensor there (a CPU fit of rec_3b_1gpu's engines stopped in conv3d, "mixed torch.Tensor and DTensor")."""
    import lightning as L

    from lightning_modules.grpo import GRPOModule
    from lightning_modules.grpo.checks import check_strategy

    module = GRPOModule(policy={"model_name_or_path": "unused"}, engines={"update_engine": "packed"})
    module.trainer = L.Trainer(accelerator="cpu", devices=1, strategy="fsdp2", precision="32-true", logger=False)
    with pytest.raises(ValueError, match="update_engine hf with --trainer.strategy fsdp2"):
        check_strategy(module.trainer, module.rollout_engine, module.update_engine)
