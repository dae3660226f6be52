"""GRPO-family methods: what differs between them (rollout plan, reward terms, advantage groups, evolution requests).

``base.py`` holds the `Method` interface, the narrow view of the module a method sees (`MethodHost`) and the registry
(``--model.method``); each method is imported when a run names it, so this package never imports its methods.
Built in: ``grpo.py`` (plain GRPO), ``syn_grpo.py`` (Syn-GRPO, the default), ``cycle_grpo.py`` (CycleGRPO, images and
video), ``evolved_grpo.py`` (EvolvedGRPO and EvolvedSynGRPO).
"""
