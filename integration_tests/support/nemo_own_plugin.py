"""A pytest plugin that runs NeMo RL's OWN loss tests with our adapter in its ``ClippedPGLossFn``'s place.

Loaded by ``nemo_own_loss_tests.run`` in a fresh pytest process (``-p integration_tests.support.nemo_own_plugin``)
on a CPU copy of NeMo RL's ``tests/unit/algorithms/test_loss_functions.py`` (the copy is made at test time;
nothing of NeMo RL's is stored here). Environment:

* ``ROLLOUT_PARITY_NEMO_OWN_TREE``: the NeMo RL source tree to import (an anchor, ``<tree>/nemo_rl``);
* ``ROLLOUT_PARITY_NEMO_OWN_MODE``: ``theirs`` (NeMo RL's class, untouched), ``off`` (``RolloutParityLossFn``
  with the shared flags all null: must be NeMo RL's loss exactly) or ``ours`` (NeMo RL's own importance-sampling
  keys carried out by our correction: ``RolloutParityLossFn.from_nemo_is_config``).

The tree stays active for the whole session: NeMo RL's test module imports ``ClippedPGLossFn`` from
``nemo_rl.algorithms.loss`` at collection, so the name is replaced there (NeMo RL's ``loss_functions`` module, which
our adapter builds the wrapped loss from, keeps NeMo RL's own class).
"""

from __future__ import annotations

import os

_STATE: dict = {}


def _factory(mode: str):
    from rollout_parity.adapters.nemo_rl import RolloutParityLossFn

    def ClippedPGLossFn(cfg=None, *args, **kwargs):  # noqa: N802 (NeMo RL's name, as its tests call it)
        if mode == "off":
            return RolloutParityLossFn(None, cfg, *args, **kwargs)
        return RolloutParityLossFn.from_nemo_is_config(cfg, *args, **kwargs)

    return ClippedPGLossFn


def pytest_configure(config):
    from rollout_parity.check.nemo_source import SOURCES

    tree = os.environ["ROLLOUT_PARITY_NEMO_OWN_TREE"]
    mode = os.environ.get("ROLLOUT_PARITY_NEMO_OWN_MODE", "theirs")
    if mode not in ("theirs", "off", "ours"):
        raise ValueError(f"ROLLOUT_PARITY_NEMO_OWN_MODE: expected theirs, off or ours, got {mode!r}")
    import torch

    # The device, as in the copy of the test file: NeMo RL's own helpers call Tensor.cuda() (model_utils.py).
    _STATE["cuda"] = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    context = SOURCES.activate(tree)
    context.__enter__()
    _STATE["context"] = context
    if mode != "theirs":
        import nemo_rl.algorithms.loss as package

        package.ClippedPGLossFn = _factory(mode)


def pytest_unconfigure(config):
    context = _STATE.pop("context", None)
    if context is not None:
        context.__exit__(None, None, None)
    if "cuda" in _STATE:
        import torch

        torch.Tensor.cuda = _STATE.pop("cuda")
