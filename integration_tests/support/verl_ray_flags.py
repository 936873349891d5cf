"""Test support: the validated flags reach every Ray process of a verl run (issue 10, verl 0.8 and 0.9).

What runs is verl's own ``run_ppo`` (its ``ray.init`` with the runtime_env it builds from the
config) on a real local Ray, with a probe in place of verl's TaskRunner; verl lets a recipe pass
its own (``task_runner_class``). The driver does what every verl ``main`` does first,
``auto_set_device(config)``, which the adapter wraps. The probe, in its own Ray process, then

* reads the flags and checks the adapter is loaded there (no ``import`` of it by the probe);
* calls verl's ``validate_config`` again, as verl 0.8's TaskRunner does after ``ray.init``;
* starts an actor the way verl's ``RayWorkerGroup`` starts its workers (its own ``env_vars``)
  and reads the flags and the adapter's state in that grandchild process;
* tries to configure different flags there, which the adapter must refuse (they could not
  reach any worker any more).

The driver imports the adapter itself and has no ``VERL_USE_EXTERNAL_MODULES``: on verl 0.8,
which has no plugin entry points, the Ray processes load the adapter only through the variable
the adapter adds to the Ray job. Back in the driver, with Ray still up: the same config configures again, a different one is
refused. Prints one JSON line.

    python -m integration_tests.support.verl_ray_flags <out.json>
"""

from __future__ import annotations

import json
import os
import sys

ADAPTER = "rollout_parity.adapters.verl"
OUT = sys.argv[1] if len(sys.argv) > 1 else None


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo import core_algos

    config_dir = os.path.abspath(os.path.join(os.path.dirname(core_algos.__file__), "..", "config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "trainer.n_gpus_per_node=1",
            "ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.include_dashboard=false",
            "+ray_kwargs.ray_init._node_ip_address=127.0.0.1", *overrides])


def _state() -> dict:
    """What this process sees: the flags, and whether verl's import loaded and applied the adapter."""
    import verl  # noqa: F401  (verl imports its plugins here; the probe never imports the adapter itself)

    loaded = ADAPTER in sys.modules
    out = {"pid": os.getpid(), "adapter_loaded": loaded, "flags": None, "applied": False}
    if loaded:
        adapter = sys.modules[ADAPTER]
        cfg = adapter.active_config()
        out.update(flags=None if cfg is None else cfg.to_dict(), applied=adapter.is_applied())
    return out


class Worker:
    def state(self) -> dict:
        return {**_state(), "rank_env": os.environ.get("RANK")}


class Probe:
    def run(self, config):
        import ray
        from omegaconf import open_dict
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        result = {"runner": _state()}
        # verl 0.8's main_ppo validates here, inside the TaskRunner, after ray.init
        validate_config(config=config, use_reference_policy=need_reference_policy(config),
                        use_critic=need_critic(config))
        result["runner_revalidated"] = _state()["flags"]
        worker = ray.remote(num_cpus=0)(Worker).options(runtime_env={"env_vars": {"RANK": "0"}}).remote()
        result["worker"] = ray.get(worker.state.remote())
        other = config.copy()
        with open_dict(other):
            other.rollout_parity = {"preset": "icepop"}
        try:
            validate_config(config=other, use_reference_policy=False, use_critic=False)
            result["runner_other_flags"] = "accepted"
        except RuntimeError as exc:
            result["runner_other_flags"] = str(exc)
        with open(OUT, "w") as f:
            json.dump(result, f)


def main() -> dict:
    # A launcher that imports the adapter itself, with no VERL_USE_EXTERNAL_MODULES in its
    # environment: on verl 0.8 (no plugin entry points) the Ray processes then load the adapter
    # only through the variable the adapter adds to the Ray job.
    from rollout_parity.adapters import verl as adapter

    import ray
    from verl.trainer.main_ppo import run_ppo
    from verl.utils.device import auto_set_device

    config = _compose("+rollout_parity.preset=tis_srs_k3")
    auto_set_device(config)  # the first call of every verl main: the adapter configures here
    run_ppo(config, task_runner_class=ray.remote(num_cpus=0)(Probe))
    with open(OUT) as f:
        result = json.load(f)
    result["driver"] = _state()
    result["driver_env_modules"] = os.environ.get("VERL_USE_EXTERNAL_MODULES")
    job = dict(ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    result["job_env"] = {k: job.get(k) for k in (adapter.ENV_CONFIG, "VERL_USE_EXTERNAL_MODULES")}
    adapter.configure_verl(config)  # Ray is up, and the job carries these very flags
    result["driver_reconfigured"] = True
    try:
        adapter.configure_verl(_compose("+rollout_parity.preset=icepop"))
        result["driver_other_flags"] = "accepted"
    except RuntimeError as exc:
        result["driver_other_flags"] = str(exc)
    ray.shutdown()
    return result


if __name__ == "__main__":
    print("RESULT_JSON " + json.dumps(main()))
