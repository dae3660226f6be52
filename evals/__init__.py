"""Offline benchmarks: what ``python -m cli.evaluate ...`` runs against a trained checkpoint, outside ``fit``.

Each module reads one benchmark in its released layout, asks the policy through the project's one greedy path
(``lightning_modules.evaluation.evaluator.greedy_answers``) and scores the answers as the released scorers do:
``benchmarks.py`` (GRES, GroundingSuite), ``gcg.py`` (GCG, with ``caption_metrics.py``'s CIDEr-D), ``gar_bench.py``
(GAR-Bench VQA), ``dlc_bench.py`` (DLC-Bench), ``vstar.py`` (V-STaR), ``dove.py`` (DOVE); ``region_benchmarks.py``,
``video_inputs.py`` and ``bench_files.py`` hold what several of them share (images, clips, predictions files).
What ``validation_step`` scores inside ``fit`` stays in ``lightning_modules/evaluation/``.
"""
