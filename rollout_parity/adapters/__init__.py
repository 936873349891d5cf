"""Thin per-framework adapters: translate, patch or subclass, revert.

Each module imports its framework inside itself and raises an ImportError naming the
extra to install (``pip install rollout-parity[trl]`` and so on) when it is missing.
"""
