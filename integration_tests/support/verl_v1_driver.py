"""Test support: verl's V1 driver step ``PPOTrainer._compute_advantage`` with our driver hook.

verl's default trainer keeps the batch in a TransferQueue. Here its key-value calls
(``kv_batch_get``/``kv_batch_put``) are answered by a dict, put in ``sys.modules`` as
``transfer_queue`` before verl's trainer module is imported (in this process only, so the
installed TransferQueue is shadowed, never touched). Everything else is verl's own code: the
nested-to-padded round trip, the correction call, GRPO advantages and the write-back. The real
TransferQueue runs in ``test_verl_main_ppo.py``. Run in its own process; prints one JSON line.

    python -m integration_tests.support.verl_v1_driver decoupled|bypass|decoupled_full

``decoupled``: TIS + seq_sum_k3 with a sampler-aware pi_old in the store (as the actor's
log-prob pass writes it: one value per position of prompt + response); ``bypass``: bypass
with rejection, after which the store's ``old_log_probs`` must be the rollout logprobs;
``decoupled_full``: TIS + seq_sum_k3 with verl's full-vocabulary pi_old (no top-k/top-p).

The trainer is verl 0.9's V1 ``verl.trainer.ppo.v1.trainer_base``, or on verl 0.8 the same
step of ``verl.trainer.main_ppo_sync`` imported as a module (only ``decoupled_full`` there: the
adapter refuses the other two on verl 0.8, whose main_ppo_sync runs as ``__main__``).
"""

from __future__ import annotations

import json
import sys
import types


class _Meta:
    def __init__(self, keys, partition_id="train"):
        self.keys, self.partition_id, self.extra_info = list(keys), partition_id, {}

    def __len__(self):
        return len(self.keys)


def _stand_in_transfer_queue(store: dict):
    tq = types.ModuleType("transfer_queue")
    tq.KVBatchMeta = _Meta

    def kv_batch_get(keys, partition_id, select_fields):
        from tensordict import TensorDict

        from verl.utils import tensordict_utils as tu

        present = {f: store[f] for f in select_fields if f in store}
        uid = present.pop("uid", None)
        td = TensorDict(present, batch_size=[len(keys)])
        if uid is not None:
            tu.assign_non_tensor_stack(td, "uid", uid)
        return td

    def kv_batch_put(keys, partition_id, fields):
        for name in fields.keys():
            store[name] = fields[name]
        return _Meta(keys, partition_id)

    tq.kv_batch_get, tq.kv_batch_put = kv_batch_get, kv_batch_put
    return tq


def main(case: str) -> dict:
    store: dict = {}
    sys.modules["transfer_queue"] = _stand_in_transfer_queue(store)

    import importlib
    import importlib.util

    import torch
    from omegaconf import OmegaConf

    from rollout_parity import CorrectionConfig, compute_correction
    from rollout_parity.core.metric_names import verl_names
    from rollout_parity.adapters import verl as adapter
    from rollout_parity.adapters._patching import MARK
    from rollout_parity.core.sampler import SamplerSettings

    v1 = importlib.util.find_spec("verl.trainer.ppo.v1") is not None
    trainer_base = importlib.import_module("verl.trainer.ppo.v1.trainer_base" if v1 else "verl.trainer.main_ppo_sync")
    patched = hasattr(trainer_base.compute_rollout_correction_and_add_to_batch, MARK)
    if case == "bypass":
        cfg = CorrectionConfig(old_logprob_source="bypass", rollout_rejection=["seq_sum_k3"],
                               rollout_rejection_threshold=0.05)
        sampler = None
    else:
        cfg = CorrectionConfig(rollout_importance_sampling_mode="token_truncate",
                               rollout_importance_sampling_threshold=1.5, rollout_rejection=["seq_sum_k3"],
                               rollout_rejection_threshold=0.05)
        sampler = SamplerSettings(top_p=0.9) if case == "decoupled" else None
    adapter.set_active_config(cfg, sampler)

    g = torch.Generator().manual_seed(0)
    n, groups, T, P = 4, 2, 6, 3
    B = n * groups
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    processed = -torch.rand(B, T, generator=g) * 2 - 0.05  # pi_old renormalised over the kept set
    # verl's full-vocabulary pi_old: log S = -0.1 below it under top_p; the same without a filter
    old = processed - 0.1 if case == "decoupled" else processed
    rollout = processed + torch.randn(B, T, generator=g) * 0.02
    rollout[1] += 0.4
    rollout[6] -= 0.5
    scores = torch.tensor([1.0, 5.0, 0.0, 1.0, 0.0, 1.0, -3.0, 1.0])
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores
    uid = [f"p{i // n}" for i in range(B)]

    def nested(t):
        return torch.nested.as_nested_tensor([t[i, :lengths[i]] for i in range(B)], layout=torch.jagged)

    # the actor's pass writes one value per position of prompt + response; the response's
    # logprobs sit at positions P-1 .. P+len-2 (verl.workers.utils.padding.response_from_nested)
    full_sequence = torch.nested.as_nested_tensor(
        [torch.cat([torch.full((P - 1,), 9.0), processed[i, :lengths[i]], torch.full((1,), 9.0)]) for i in range(B)],
        layout=torch.jagged)
    store.update(response_mask=nested(mask.long()), rm_scores=nested(rewards), rollout_log_probs=nested(rollout),
                 uid=uid, **{adapter.PROCESSED_FIELD: full_sequence,
                             adapter.OUTSIDE_FIELD: torch.nested.as_nested_tensor(
                                 [torch.zeros(P + int(lengths[i])) for i in range(B)], layout=torch.jagged)})
    store["old_log_probs"] = nested(processed if case == "bypass" else old)  # bypass: pi_theta at the start
    keys = [f"{uid[i]}_{i % n}_0" for i in range(B)]
    config = OmegaConf.create({
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True,
                      "use_kl_in_reward": False,
                      "rollout_correction": {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_rs": None,
                                             "rollout_rs_threshold": None, "bypass_mode": False}},
        "actor_rollout_ref": {"rollout": {"n": n}},
    })
    metrics: dict = {}
    trainer_base.PPOTrainer._compute_advantage(types.SimpleNamespace(config=config), _Meta(keys), metrics)

    def padded(name):
        return torch.nested.to_padded_tensor(store[name], 0.0, output_size=(B, T)) if store[name].is_nested \
            else store[name]

    if case == "bypass":
        core = compute_correction(cfg, rollout_logprobs=rollout, current_logprobs=processed, response_mask=mask,
                                  with_metrics=True)
    else:
        core = compute_correction(cfg, old_logprobs=processed, rollout_logprobs=rollout, response_mask=mask,
                                  with_metrics=True)
    kept = core.mask.bool().any(-1)
    expected_adv = torch.zeros(B, T)
    for i in range(B):
        if kept[i]:
            sib = torch.stack([scores[j] for j in range(B) if uid[j] == uid[i] and kept[j]])
            expected_adv[i] = (scores[i] - sib.mean()) / (sib.std() + 1e-6) * core.mask[i]
    result = {
        "trainer": trainer_base.__name__,
        "patched": patched,
        "mask_equal": torch.equal(padded("response_mask").float(), core.mask),
        "adv_max_diff": (padded("advantages") - expected_adv).abs().max().item(),
        "rejected_rows": (~kept).nonzero().flatten().tolist(),
        # the driver logs the core's values under verl's rollout_corr/* names where verl has the formula
        "metrics_equal": all(abs(metrics[k] - v) <= 1e-6 for k, v in verl_names(core.metrics, cfg).items()
                             if k in metrics),
        "metric_keys": sorted(metrics),
    }
    if case == "bypass":
        result["old_is_rollout"] = torch.equal(padded("old_log_probs") * mask, rollout * mask)
    else:
        result["weights_max_diff"] = (padded("rollout_is_weights") - core.weights).abs().max().item()
    if case == "decoupled":
        # with verl's full-vocabulary pi_old the log S = -0.1 bias would have changed weights and rejection
        biased = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
        result["sampler_old_used"] = result["weights_max_diff"] < 1e-6 and not torch.allclose(
            biased.weights, core.weights, atol=1e-3)
    return result


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "decoupled")))
