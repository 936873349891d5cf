"""Turning the NeMo RL adapter on from a recipe YAML, through NeMo RL's own setup path.

A recipe (``support/nemo_recipes/tiny_grpo.yaml``, a stand-in for a user's recipe) lists the
shipped block ``configs/nemo_rl_loss.yaml`` under ``defaults:``. It is read the way NeMo RL's
``examples/run_grpo.py`` reads it (``register_omegaconf_resolvers``, ``load_config``,
``OmegaConf.to_container(resolve=True)``, ``MasterConfig(**config)``) and handed to NeMo RL's real
``grpo.setup()`` at v0.7.0 and main. On CPU the four collaborators that start Ray and GPU
workers (``Logger``, ``RayVirtualCluster``, ``Policy``, ``VllmGeneration``) are mocks; everything
else in ``setup()`` runs, with the real dataloaders and ``CheckpointManager``. NeMo RL's own
``async_grpo_train`` is run up to its first use of a GPU-side object, past the assertion it makes
on ``use_importance_sampling_correction``. ``rollout-parity launch`` is run in fresh processes on
a script doing what ``run_grpo.py`` does (NeMo RL's examples are not in ``../shared/anchors``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import load, nemo_data, train_step
from rollout_parity import CorrectionConfig
from rollout_parity.adapters import nemo_rl as adapter
from rollout_parity.adapters._patching import MARK
from rollout_parity.adapters.nemo_rl import turn_on

pytestmark = [pytest.mark.nemo_rl]

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "integration_tests" / "support" / "nemo_recipes" / "tiny_grpo.yaml"
BLOCK = ROOT / "configs" / "nemo_rl_loss.yaml"
GPU_SIDE = ("Logger", "RayVirtualCluster", "Policy", "VllmGeneration")


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        load(ns)
        ns.grpo = ns.load("nemo_rl.algorithms.grpo")
        ns.config = ns.load("nemo_rl.utils.config")
        ns.loss_functions = ns.load("nemo_rl.algorithms.loss.loss_functions")
        yield ns


@pytest.fixture
def hook(nemo):
    grpo_name, init = nemo.grpo.ClippedPGLossFn, nemo.loss_functions.ClippedPGLossFn.__dict__["__init__"]
    adapter.apply()
    try:
        yield
    finally:
        adapter.revert()
        # Reverted bit for bit: the originals themselves are back, the resolver is gone.
        assert nemo.grpo.ClippedPGLossFn is grpo_name is nemo.loss_functions.ClippedPGLossFn
        assert nemo.loss_functions.ClippedPGLossFn.__dict__["__init__"] is init
        assert not adapter.is_applied()


def recipe(tmp_path: Path, extra: str = "", block: bool = True) -> Path:
    """A user's recipe: the tiny GRPO recipe, our shipped block, their own overrides."""
    defaults = [str(TINY)] + ([str(BLOCK)] if block else [])
    path = tmp_path / "recipe.yaml"
    path.write_text("defaults:\n" + "".join(f"  - {d}\n" for d in defaults) + textwrap.dedent(extra))
    return path


def master_config(ns, path: Path):
    """What NeMo RL's ``examples/run_grpo.py`` ``main()`` does with ``--config``."""
    from omegaconf import OmegaConf

    ns.config.register_omegaconf_resolvers()
    config = ns.config.load_config(str(path))
    config = OmegaConf.to_container(config, resolve=True)
    return ns.grpo.MasterConfig(**config)


def setup(ns, config):
    """NeMo RL's own ``grpo.setup()``, its GPU-side collaborators mocked."""
    with mock.patch.multiple(ns.grpo, **{name: mock.DEFAULT for name in GPU_SIDE}):
        return ns.grpo.setup(config, None, [1, 2, 3] * 10, None)


# ----------------------------------------------------------------- the recipe alone turns it on


def test_recipe_with_the_block_gives_setup_our_loss(nemo, hook, tmp_path):
    out = setup(nemo, master_config(nemo, recipe(tmp_path)))
    loss_fn = out[6]  # what run_grpo.py hands to grpo_train
    assert isinstance(loss_fn, adapter.RolloutParityLossFn)
    assert loss_fn.correction == CorrectionConfig.preset("tis_srs_k3")
    inner = loss_fn.nemo_loss_fn
    assert type(inner) is nemo.loss_functions.ClippedPGLossFn  # NeMo RL's own loss inside
    # The recipe's own NeMo RL keys reached NeMo RL's loss, and NeMo RL reads them off ours.
    assert (inner.reference_policy_kl_penalty, inner.reference_policy_kl_type) == (0.01, "k3")
    assert loss_fn.reference_policy_kl_penalty == 0.01 and loss_fn.loss_type == nemo.LossType.TOKEN_LEVEL
    assert turn_on.built() == [repr(loss_fn)]
    # And it trains: one step of the worker's loop on a small batch.
    import torch

    cur = torch.full((2, 4), -1.0, requires_grad=True)
    data = nemo_data(nemo, torch.full((2, 4), -1.1), torch.full((2, 4), -1.2), cur, torch.ones(2, 4),
                     torch.tensor([1.0, -1.0]))
    total, metrics = train_step(nemo, loss_fn, data, 2)
    assert total == total and cur.grad is not None and "rollout_correction/is_weight_mean" in metrics[0]


def test_fp32_lm_head_is_refused_in_setup_before_any_worker_starts(nemo, hook, tmp_path):
    """NeMo RL's trainer head stays bf16 (test_nemo_rl_fp32_head.py): the flag stops grpo.setup() at the loss."""
    config = master_config(nemo, recipe(tmp_path, """
        loss_fn:
          rollout_correction:
            fp32_lm_head: true
        """))
    with mock.patch.multiple(nemo.grpo, **{name: mock.DEFAULT for name in GPU_SIDE}) as mocks:
        with pytest.raises(ValueError, match="rollout_correction.fp32_lm_head=True cannot be served on NeMo RL"):
            nemo.grpo.setup(config, None, [1, 2, 3] * 10, None)
    assert not any(mocks[name].called for name in ("RayVirtualCluster", "Policy", "VllmGeneration"))


def test_recipe_with_the_block_without_the_hook_stops_at_config_load(nemo, tmp_path):
    """Never silently uncorrected: NeMo RL's own config path refuses the guard line."""
    from omegaconf.errors import UnsupportedInterpolationType

    assert not adapter.is_applied()
    with pytest.raises(UnsupportedInterpolationType, match="rollout_parity") as info:
        master_config(nemo, recipe(tmp_path))
    assert "loss_fn.rollout_parity" in str(info.value)


def test_recipe_without_the_block_keeps_nemos_own_loss_under_the_hook(nemo, hook, tmp_path):
    out = setup(nemo, master_config(nemo, recipe(tmp_path, block=False)))
    assert type(out[6]) is nemo.loss_functions.ClippedPGLossFn
    assert turn_on.built() == []


def test_other_code_building_nemos_loss_from_the_block_is_refused(nemo, hook):
    """PPO, the single-controller setup or a custom launcher build NeMo RL's class themselves:
    under the hook a block carrying our keys never reaches it silently."""
    cfg = nemo.ClippedPGLossConfig(reference_policy_kl_penalty=0.0, rollout_correction={})
    with pytest.raises(RuntimeError, match=r"test_nemo_rl_turn_on\.py:\d+.*would train without the correction"):
        nemo.ClippedPGLossFn(cfg)
    nemo.ClippedPGLossFn(nemo.ClippedPGLossConfig(reference_policy_kl_penalty=0.0))  # any other block: as ever


def test_patch_is_the_shared_layers_wrapper_applied_once(nemo, hook):
    name, init = nemo.grpo.ClippedPGLossFn, nemo.loss_functions.ClippedPGLossFn.__init__
    assert getattr(name, MARK) and getattr(init, MARK)
    assert name.__wrapped__ is nemo.loss_functions.ClippedPGLossFn
    adapter.apply()  # idempotent: the same wrappers, never stacked
    assert nemo.grpo.ClippedPGLossFn is name and nemo.loss_functions.ClippedPGLossFn.__init__ is init
    assert init.__wrapped__.__qualname__ == "ClippedPGLossFn.__init__" and not hasattr(init.__wrapped__, MARK)


def test_a_missing_name_is_refused_before_anything_is_patched(nemo, monkeypatch):
    """A NeMo RL whose grpo module lacks the name setup() uses: an error naming it, and the
    guard already patched is taken back (all or nothing)."""
    init = nemo.loss_functions.ClippedPGLossFn.__dict__["__init__"]
    monkeypatch.delattr(nemo.grpo, "ClippedPGLossFn")
    with pytest.raises(ImportError, match=r"nemo_rl\.algorithms\.grpo\.ClippedPGLossFn"):
        adapter.apply()
    try:
        assert nemo.loss_functions.ClippedPGLossFn.__dict__["__init__"] is init
        assert not adapter.is_applied()
    finally:
        adapter.revert()


# ----------------------------------------------------------------- async GRPO and FP8 generation


ASYNC = """
grpo:
  async_grpo: {enabled: true}
policy:
  generation:
    vllm_cfg: {async_engine: true}
loss_fn:
  use_importance_sampling_correction: %s
"""
FP8 = """
policy:
  generation:
    vllm_cfg: {precision: fp8}
loss_fn:
  use_importance_sampling_correction: %s
"""


class _PastTheAssertions(Exception):
    pass


def test_async_grpo_passes_nemos_assertion_with_our_weight_applied_once(nemo, hook, tmp_path):
    """NeMo RL's async trainer asserts ``loss_fn.use_importance_sampling_correction``. With our
    block the recipe sets it true, NeMo RL's assertion passes, and inside the wrapper NeMo RL's
    IS is off: our weight is the one applied. Without it NeMo RL refuses, as it always did."""
    for switch in (True, False):
        out = setup(nemo, master_config(nemo, recipe(tmp_path, ASYNC % str(switch).lower())))
        loss_fn = out[6]
        assert isinstance(loss_fn, adapter.RolloutParityLossFn)
        assert loss_fn.nemo_loss_fn.use_importance_sampling_correction is False
        kwargs = dict(policy=out[0], policy_generation=out[1], dataloader=out[4], val_dataloader=out[5],
                      tokenizer=None, loss_fn=loss_fn, task_to_env={}, val_task_to_env={}, logger=out[7],
                      checkpointer=out[8], grpo_save_state=out[9], master_config=out[10])
        # Timer() is the first thing async_grpo_train builds after its assertions.
        with mock.patch.object(nemo.grpo, "Timer", side_effect=_PastTheAssertions):
            if switch:
                with pytest.raises(_PastTheAssertions):
                    nemo.grpo.async_grpo_train(**kwargs)
            else:
                with pytest.raises(AssertionError, match="Importance sampling correction must be enabled"):
                    nemo.grpo.async_grpo_train(**kwargs)


def test_fp8_generation_passes_nemos_assertion_in_setup(nemo, hook, tmp_path):
    out = setup(nemo, master_config(nemo, recipe(tmp_path, FP8 % "true")))
    assert isinstance(out[6], adapter.RolloutParityLossFn)
    assert out[6].nemo_loss_fn.use_importance_sampling_correction is False
    with pytest.raises(AssertionError, match="Importance sampling must be enabled for vLLM FP8"):
        setup(nemo, master_config(nemo, recipe(tmp_path, FP8 % "false")))


# ----------------------------------------------------------------- rollout-parity launch, fresh processes

# Does what NeMo RL's examples/run_grpo.py main() does up to handing loss_fn to the trainer
# (that file is not in ../shared/anchors); the GPU-side collaborators are mocked, as above.
RUN_GRPO = '''
import argparse, json
from unittest import mock
from omegaconf import OmegaConf
from nemo_rl.algorithms import grpo
from nemo_rl.algorithms.grpo import MasterConfig, setup
from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers

def main():
    register_omegaconf_resolvers()
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    args, overrides = parser.parse_known_args()
    config = load_config(args.config)
    if overrides:
        config = parse_hydra_overrides(config, overrides)
    config = MasterConfig(**OmegaConf.to_container(config, resolve=True))
    with mock.patch.multiple(grpo, Logger=mock.DEFAULT, RayVirtualCluster=mock.DEFAULT, Policy=mock.DEFAULT,
                             VllmGeneration=mock.DEFAULT):
        loss_fn = setup(config, None, [1, 2, 3] * 10, None)[6]
    with open(config.logger["log_dir"] + "/loss_fn.json", "w") as f:  # what grpo_train would get
        json.dump({"type": type(loss_fn).__name__,
                   "flags": loss_fn.correction.to_dict() if hasattr(loss_fn, "correction") else None}, f)

if __name__ == "__main__":
    main()
'''
# Stands in for NeMo RL being installed: its source tree importable (the anchor), nothing imported.
BOOT = '''
import sys
from integration_tests.support.nemo_anchor import ANCHORS
from rollout_parity.cli import main
with ANCHORS.activate(sys.argv[1]):
    assert "nemo_rl.algorithms.grpo" not in sys.modules
    if sys.argv[2] == "launch":
        code = main(sys.argv[2:])
    else:
        import runpy
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
sys.exit(code)
'''


def launch(tmp_path: Path, version: str, *argv: str) -> subprocess.CompletedProcess:
    skip_unless_available([version])
    (tmp_path / "run_grpo.py").write_text(RUN_GRPO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", BOOT, version, *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("version", VERSIONS)
def test_rollout_parity_launch_runs_the_users_entry_point_with_our_loss(tmp_path, version):
    """``rollout-parity launch run_grpo.py --config recipe.yaml loss_fn.rollout_correction...=``:
    the hook is on before the script imports NeMo RL's grpo (the import hook patches it then),
    and a Hydra override of ours on the command line reaches the loss like any other."""
    path = recipe(tmp_path, f"logger:\n  log_dir: {tmp_path}\n")
    result = launch(tmp_path, version, "launch", "run_grpo.py", "--config", str(path),
                    "loss_fn.rollout_correction.rollout_rejection_threshold=0.01")
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads((tmp_path / "loss_fn.json").read_text())
    assert got["type"] == "RolloutParityLossFn"
    assert CorrectionConfig.from_dict(got["flags"]) == CorrectionConfig.preset("tis_srs_k3",
                                                                               rollout_rejection_threshold=0.01)
    assert "no loss_fn carried" not in result.stderr


def test_launch_without_the_block_and_the_script_without_launch(tmp_path):
    version = VERSIONS[-1]
    plain = recipe(tmp_path, f"logger:\n  log_dir: {tmp_path}\n", block=False)
    result = launch(tmp_path, version, "launch", "run_grpo.py", "--config", str(plain))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "loss_fn.json").read_text())["type"] == "ClippedPGLossFn"
    assert "no loss_fn carried rollout_correction, so NeMo RL's own loss ran unchanged" in result.stderr
    # The user's usual command without the hook: NeMo RL stops at config load, naming the line.
    with_block = recipe(tmp_path, f"logger:\n  log_dir: {tmp_path}\n")
    result = launch(tmp_path, version, "run_grpo.py", "--config", str(with_block))
    assert result.returncode != 0
    assert "UnsupportedInterpolationType" in result.stderr and "loss_fn.rollout_parity" in result.stderr
    # Shared flags on the launcher's command line are not NeMo RL's way: refused, not dropped.
    result = launch(tmp_path, version, "launch", "--rollout_importance_sampling_mode", "token_mask",
                    "run_grpo.py", "--config", str(with_block))
    assert result.returncode == 2 and "takes the shared flags from its recipe" in result.stderr
