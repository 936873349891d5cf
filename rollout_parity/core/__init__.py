"""The torch-only core: every formula of rollout-parity lives here, once.

Nothing under ``core`` imports a training or inference framework; adapters translate
their framework's tensors and configs into calls of this package.
"""
