"""The runner: what drives ``train.py`` from outside a fit, and reads what its runs logged (docs/layout.md).

Commands: ``python -m runner.study`` (Table 1's studies, docs/study.md), ``python -m runner.sweep`` (a W&B sweep
file's grid offline, docs/analysis.md) and ``python -m cli.coevolve`` (EvolvedGRPO's co-evolution rounds,
docs/evolved_coevolution.md). Modules, one job each:

- `points`: ``train.py`` command lines run as processes, a bounded number at a time (sweeps and studies);
- `sweep`: the sweep file, its grid and results table, and its command;
- `study`, `study_file`, `study_plan`, `study_records`, `study_report`, `study_training`, `stats`: the study's command,
  its file, its runs and shards, their records, the held-out table, the training curves, the intervals;
- `runs`, `wandb_runs`, `analysis`, `figures`, `outputs`: logged runs read back (the local metrics file, W&B), many
  runs and their tables, the notebook's figures and where they go;
- `coevolution_config`, `coevolution_rounds`, `coevolution_edits`: the rounds' config, the rounds (stages, resumption;
  ``train.py`` per stage) and the edit stage that builds D_{k+1};
- ``build_vllm_venv.sh``: the vLLM environment (``make vllm-venv``, docs/vllm.md).
"""
