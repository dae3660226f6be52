"""The training side of the project, as the story of a GRPO step (each layer imports only the ones before it):

1. ``models/``: the policy: loading, prompts, the `Rollout` record, Qwen-VL helpers, the toy model, precision, FSDP2;
2. ``engines/``: rollout engines turn prompts into a `Rollout`, update engines score it and run the backward;
3. ``evaluation/``: greedy answers through a rollout engine, and the metrics of every eval set;
4. ``methods/``: what a GRPO-family method decides: rollout plan, reward terms, advantage groups, evolution requests;
5. ``grpo/``: `GRPOModule`, the loop: plan -> generate -> score -> advantage -> update -> log; ``sft.py``: the SFT
   stage.

Beside them, imported from any layer: ``registry.py`` (name -> class registries, resolved lazily), ``checkpoints.py``
(Lightning's single-file checkpoint writer; the checkpoint files' staging and checks are in ``core/checkpoint_files.py``)
and ``judge.py`` (the judge's client). The GRPO objective is pure tensor
functions, in ``core/objective.py``; the reward functions of completions are plain functions of text, in
``core/rewards.py`` and ``core/question_rewards.py``.
"""
