"""vLLM's side of the engine seam.

``features`` (which release has what), ``recipe`` (engine kwargs, ``vllm serve`` flags, ``verify_engine``),
``head`` (the head dtype each engine process reports), ``weight_update`` (updates in flight and between
rounds), ``moe`` (fused-MoE weight loads), ``names`` and ``source`` (every vLLM-internal name we reach, checked
against the installed vLLM and read from its source), ``fp16_models`` (the models vLLM runs in float16). The
vLLM plugin that runs inside vLLM's processes stays at ``rollout_parity.adapters.vllm`` (its entry point).
No module here imports vLLM at module level.
"""
