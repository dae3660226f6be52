"""Rollout and update engines: how completions are generated and how they are scored and trained on.

``base.py`` holds the two interfaces and their registries (``--model.engines.rollout_engine``, ``--model.engines.update_engine``);
each engine is imported when a run names it, so this package never imports its engines. Built in:

- rollout ``hf`` / ``hf_shared`` (``hf.py``: ``model.generate``, or one prefill shared by a group), ``fast``
  (``fast.py`` over ``decode.py``: static KV cache, one prefill per group, CUDA-graph decode) and ``vllm``
  (``vllm.py`` over ``vllm_backend.py``; ``vllm_server.py`` serves it from another process);
- update ``hf`` (``hf.py``: the model's own forward per micro-batch), ``packed`` (``packed.py`` over
  ``packing.py``: vision tower once per image, right-padded length-bucketed rows, chunked log-probs) and
  ``packed_shared`` (``shared_prompt.py``: ``packed`` with each prompt scored once per group under a mask);
- ``vision_cache.py``: vision features kept per image while the vision weights stay the same.
"""
