"""Test support: a deliberately broken verl weight sync (loaded through ``VERL_USE_EXTERNAL_MODULES``).

With ``ROLLOUT_PARITY_TEST_DROP_SYNC=<name prefix>@<k>`` in the environment, verl's
``ServerAdapter.update_weights`` (the actor's side of its colocated sync) leaves every tensor whose
name starts with the prefix out of the stream from the k-th sync of this process on: the rollout
server keeps that group at its old values, as a buggy sync would. Without the variable it does nothing.
"""

from __future__ import annotations

import functools
import os

ENV = "ROLLOUT_PARITY_TEST_DROP_SYNC"


def _install() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    prefix, _, first = spec.rpartition("@")
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    original = ServerAdapter.update_weights
    count = [0]

    @functools.wraps(original)
    async def update_weights(self, weights, *args, **kwargs):
        count[0] += 1
        print(f"[verl_sync_breaker] sync {count[0]} (global_steps={kwargs.get('global_steps')})", flush=True)
        if count[0] >= int(first):
            print(f"[verl_sync_breaker] sync {count[0]}: dropping {prefix}*", flush=True)
            weights = ((name, tensor) for name, tensor in weights if not name.startswith(prefix))
        return await original(self, weights, *args, **kwargs)

    ServerAdapter.update_weights = update_weights


_install()
