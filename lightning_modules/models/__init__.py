"""The policy: loading it, prompting it, and how it is held in memory (the record of what it generated, `Rollout`, is
``core/rollout.py``).

``loading.py``: ``(model, processor)`` from a checkpoint; ``prompts.py``: a prompt rendered by the processor's chat
template (the templates' text is ``core/prompts.py``), the token ids a rollout masks; ``clip_similarity.py``: CLIP's
image-image similarity; ``qwen_vl.py``: the Qwen-VL pieces every fast path shares (model parts, mRoPE positions, processor calls, box frames);
``tiny_model.py``: the toy checkpoint's factory; ``precision.py``: fp32 master weights; ``fsdp.py``: FSDP2 sharding and
the ``fsdp2`` strategy. Nothing here imports the engines, methods or the training loop.
"""
