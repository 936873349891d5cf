"""Rollout engines behind one seam: each engine's package holds all that is specific to it.

``engines/spec.py`` is what every engine shares (the prefix-cache policies, the errors adapters catch);
``engines/vllm/`` is vLLM's side (recipe, release table, live-engine checks, weight updates, MoE weight loads,
the names we reach inside vLLM). ``core`` imports no engine; adapters and the doctor reach an engine through
its package. Nothing here imports an engine at module level.
"""
