"""Rollout and update engines behind one interface each, registered by name (``engines.base``).

Built in: rollout ``hf`` (``model.generate``) and ``fast`` (static KV cache, one prefill per group, CUDA-graph
decode: ``lightning_modules/rollout.py``); update ``hf`` (the model's own forward per micro-batch) and ``packed``
(vision tower once per image, right-padded length-bucketed rows, chunked log-probs: ``lightning_modules/efficient.py``).
"""

from lightning_modules.engines import fast, hf, packed, vllm  # noqa: F401 - registers the built-in engines (vllm imports vLLM lazily)
from lightning_modules.engines.base import (
    ROLLOUT_ENGINES,
    UPDATE_ENGINES,
    LossFn,
    RolloutEngine,
    RolloutRequest,
    Sampling,
    UpdateEngine,
    build_rollout_engine,
    build_update_engine,
    register_rollout_engine,
    register_update_engine,
)

__all__ = [
    "ROLLOUT_ENGINES",
    "UPDATE_ENGINES",
    "LossFn",
    "RolloutEngine",
    "RolloutRequest",
    "Sampling",
    "UpdateEngine",
    "build_rollout_engine",
    "build_update_engine",
    "register_rollout_engine",
    "register_update_engine",
]
