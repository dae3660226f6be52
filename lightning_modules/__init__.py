"""The training side of the project, as the story of a GRPO step (each layer imports only the ones before it):

1. ``models/``: the policy: loading, prompts, Qwen-VL helpers, the toy model, precision, FSDP2;
2. ``engines/``: rollout engines turn prompts into a `Rollout`, update engines score it and run the backward;
3. ``evaluation/``: greedy answers through a rollout engine, and the metrics of every eval set;
4. ``methods/``: what a GRPO-family method decides: rollout plan, reward terms, advantage groups, evolution requests;
5. ``grpo/``: `GRPOModule`, the loop: plan -> generate -> score -> advantage -> update -> log; ``sft.py``: the SFT
   stage.

Beside them, imported from any layer: ``checkpoints.py`` (Lightning's single-file checkpoint writer) and ``judge.py``
(the judge's client). Pure code they share with packages above or with tools outside ``fit`` sits in ``core/``, below
all of them: the `Rollout` record (``core/rollout.py``), the GRPO objective as pure tensor functions
(``core/objective.py``), the name -> class registries (``core/registry.py``), the checkpoint files' staging and checks
(``core/checkpoint_files.py``), and the reward functions of completions, plain functions of text (``core/rewards.py``,
``core/question_rewards.py``).
"""
