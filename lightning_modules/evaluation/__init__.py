"""Evaluation: one greedy path for every module and callback, and the metrics it logs.

``evaluator.py``: `greedy_answers` (one greedy completion per sample through a rollout engine, read back) and
`Evaluator` (the torchmetrics of every named eval set, logged by `GRPOModule` and `SFTModule` alike);
``metrics.py``: REC / OVD grounding and detection metrics; ``cycle_metrics.py``: CycleGRPO's region, temporal and
spatio-temporal metrics and locatability.
"""
