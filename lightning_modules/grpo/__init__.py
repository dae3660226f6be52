"""The GRPO loop: `GRPOModule` (``module.py``: hyperparameters, policy and reference, the step, evaluation,
checkpointed state) and the Lightning-free parts of its step (``step.py``: phase timing, a micro-batch's loss, the
step's logs and outputs). Configs name it as ``lightning_modules.grpo.GRPOModule``."""

from lightning_modules.grpo.module import GRPOModule

__all__ = ["GRPOModule"]
