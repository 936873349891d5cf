"""The ``precision`` flag through the NeMo RL adapter, against NeMo RL's own config reading at v0.7.0 and main.

A user's recipe (``support/nemo_recipes/tiny_grpo.yaml`` with the shipped block, as in
test_nemo_rl_turn_on.py) carrying ``loss_fn.rollout_correction.precision`` is read the way NeMo RL's
``examples/run_grpo.py`` reads it (``load_config``, ``parse_hydra_overrides``, ``to_container``,
``MasterConfig``) and handed to NeMo RL's real ``grpo.setup()`` with the hook on (its GPU-side collaborators
mocked, so the configs it hands its workers are recorded). Then NeMo RL's own readers of the two keys:
its vLLM worker's engine assembly (``BaseVllmGenerationWorker._load_model``: ``vllm_cfg.precision`` becomes
``vllm.LLM(dtype=...)``), its Megatron precision setup and check (``_apply_precision_config``,
``_validate_dtype_config``), and at main ``grpo._policy_dtype``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from integration_tests.support.nemo_anchor import ANCHORS, VERSIONS, skip_unless_available
from integration_tests.support.nemo_harness import load
from rollout_parity.adapters import nemo_rl as adapter
from rollout_parity.adapters.nemo_rl import precision as nemo_precision
from rollout_parity.adapters.nemo_rl import nemo_rl_generation_config

pytestmark = [pytest.mark.nemo_rl]

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "integration_tests" / "support" / "nemo_recipes" / "tiny_grpo.yaml"
BLOCK = ROOT / "configs" / "nemo_rl_loss.yaml"
GPU_SIDE = ("Logger", "RayVirtualCluster", "Policy", "VllmGeneration")
FP16 = """
loss_fn:
  rollout_correction:
    precision: fp16
"""


@pytest.fixture(scope="module", params=VERSIONS)
def nemo(request):
    skip_unless_available()
    with ANCHORS.activate(request.param) as ns:
        load(ns)
        ns.grpo = ns.load("nemo_rl.algorithms.grpo")
        ns.config = ns.load("nemo_rl.utils.config")
        ns.megatron = ns.load("nemo_rl.models.megatron.setup")
        ns.vllm_worker = ns.load("nemo_rl.models.generation.vllm.vllm_worker")
        yield ns


@pytest.fixture
def hook(nemo):
    adapter.apply()
    nemo_precision._warned.clear()
    try:
        yield
    finally:
        adapter.revert()
        nemo_precision._warned.clear()


def recipe(tmp_path: Path, extra: str = "", block: bool = True) -> Path:
    defaults = [str(TINY)] + ([str(BLOCK)] if block else [])
    path = tmp_path / "recipe.yaml"
    path.write_text("defaults:\n" + "".join(f"  - {d}\n" for d in defaults) + textwrap.dedent(extra))
    return path


def master_config(ns, path: Path, *overrides: str):
    """What NeMo RL's ``examples/run_grpo.py`` ``main()`` does with ``--config`` and its command line."""
    from omegaconf import OmegaConf

    ns.config.register_omegaconf_resolvers()
    config = ns.config.load_config(str(path))
    if overrides:
        config = ns.config.parse_hydra_overrides(config, list(overrides))  # ours once the hook is on
    return ns.grpo.MasterConfig(**OmegaConf.to_container(config, resolve=True))


def setup(ns, config):
    """NeMo RL's own ``grpo.setup()``, its GPU-side collaborators mocked: returns the mocks (the configs handed
    to ``Policy`` and ``VllmGeneration``) and setup's output."""
    with mock.patch.multiple(ns.grpo, **{name: mock.DEFAULT for name in GPU_SIDE}) as mocks:
        out = ns.grpo.setup(config, None, [1, 2, 3] * 10, None)
    return mocks, out


def engine_kwargs(ns, monkeypatch, generation: dict) -> dict:
    """The ``vllm.LLM(**kwargs)`` NeMo RL's own ``BaseVllmGenerationWorker._load_model`` builds from a generation
    config; ``self.precision`` as its ``_init_config`` sets it (``self.cfg["vllm_cfg"]["precision"]``)."""
    from rollout_parity.testing.tiny_model import build_tiny_model

    monkeypatch.setattr(ns.vllm_worker, "log_gpu_memory_diagnostics", lambda *a, **k: None)  # NVML
    for var in ("VLLM_USE_V1", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(var, raising=False)
    model = build_tiny_model()
    vllm_cfg = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "expert_parallel_size": 1,
                "gpu_memory_utilization": 0.6, "max_model_len": 256, "skip_tokenizer_init": False,
                "load_format": "auto", "enforce_eager": True, "async_engine": False, "kv_cache_dtype": "auto",
                **generation["vllm_cfg"]}
    vllm_kwargs = dict(generation.get("vllm_kwargs", {}), hf_overrides={})
    cls = ns.vllm_worker.BaseVllmGenerationWorker
    worker = cls.__new__(cls)
    worker.cfg = {"model_name": model, "vllm_cfg": vllm_cfg, "vllm_kwargs": vllm_kwargs}
    worker.model_name, worker.precision, worker.fraction_of_gpus = model, vllm_cfg["precision"], 1.0
    worker.tensor_parallel_size = worker.pipeline_parallel_size = worker.expert_parallel_size = 1
    worker.enable_expert_parallel, worker.gpu_memory_utilization = False, 0.5
    captured: dict = {}
    worker._create_engine = captured.update
    cls._load_model(worker, None, 0)
    return captured


def policy_dtype(ns, policy: dict):
    """The trainer's dtype as NeMo RL resolves ``policy.precision`` (main: ``grpo._policy_dtype``; v0.7.0's
    workers use the same name-to-dtype map, ``getattr(torch, name)`` for its three names)."""
    import torch

    resolve = getattr(ns.grpo, "_policy_dtype", None)
    return resolve(policy) if resolve is not None else getattr(torch, policy["precision"])


# ----------------------------------------------------------------- the flag sets both sides


def test_the_flag_sets_the_trainer_and_the_engine_dtype_before_setup_builds_a_worker(nemo, hook, tmp_path,
                                                                                      monkeypatch, capsys):
    import torch

    config = master_config(nemo, recipe(tmp_path, FP16))
    assert config.policy["precision"] == "float32"  # the recipe's (tiny_grpo.yaml), overwritten and said so
    mocks, out = setup(nemo, config)
    assert isinstance(out[6], adapter.RolloutParityLossFn) and out[6].correction.precision == "fp16"
    policy = mocks["Policy"].call_args.kwargs["config"]
    generation = mocks["VllmGeneration"].call_args.kwargs["config"]
    assert policy["precision"] == generation["vllm_cfg"]["precision"] == "float16"
    assert policy_dtype(nemo, policy) == torch.float16
    assert engine_kwargs(nemo, monkeypatch, generation)["dtype"] == "float16"  # vllm.LLM(dtype=...)
    out = capsys.readouterr().out
    assert ("[rollout-parity] NeMo RL settings overridden: policy.precision: 'float32' -> 'float16'; "
            "policy.generation.vllm_cfg.precision: 'float32' -> 'float16'") in out


def test_the_same_value_on_the_command_line_is_fine_and_nothing_is_said(nemo, hook, tmp_path, capsys):
    config = master_config(nemo, recipe(tmp_path, FP16), "policy.precision=float16",
                           "policy.generation.vllm_cfg.precision=half")
    mocks, _ = setup(nemo, config)
    assert mocks["Policy"].call_args.kwargs["config"]["precision"] == "float16"
    assert "overridden" not in capsys.readouterr().out


def test_megatron_gets_the_optimizer_keys_nemos_own_check_asks_for(nemo, hook, tmp_path):
    """With ``use_precision_aware_optimizer`` NeMo RL asserts the Megatron optimizer's fp16 flag matches
    ``policy.precision`` (``_validate_dtype_config``); the flag writes it, and Megatron's optimizer then scales
    the loss. Written as the recipe's own keys would have been, NeMo RL's own setup functions accept them."""
    from omegaconf import OmegaConf

    megatron = """
    policy:
      precision: bfloat16
      generation:
        vllm_cfg:
          precision: ${policy.precision}
      megatron_cfg:
        enabled: true
        pipeline_dtype: bfloat16
        optimizer: {use_precision_aware_optimizer: true, bf16: true, fp16: false}
    """
    nemo.config.register_omegaconf_resolvers()
    raw = OmegaConf.to_container(nemo.config.load_config(str(recipe(tmp_path, FP16 + textwrap.dedent(megatron)))),
                                 resolve=True)
    # NeMo RL's own check refuses the recipe with policy.precision alone set to float16
    alone = {**raw["policy"], "precision": "float16"}
    model_cfg = SimpleNamespace()
    nemo.megatron._apply_precision_config(model_cfg, alone, policy_dtype(nemo, alone))
    with pytest.raises(AssertionError, match="optimizer.fp16=True must be set"):
        nemo.megatron._validate_dtype_config(policy_dtype(nemo, alone), model_cfg,
                                             SimpleNamespace(**alone["megatron_cfg"]["optimizer"]))
    assert nemo_precision.configure_precision(raw, explicit=()) == "fp16"
    policy = raw["policy"]
    assert policy["precision"] == policy["generation"]["vllm_cfg"]["precision"] == "float16"
    assert policy["megatron_cfg"]["optimizer"]["fp16"] is True and policy["megatron_cfg"]["optimizer"]["bf16"] is False
    dtype = policy_dtype(nemo, policy)
    model_cfg = SimpleNamespace()
    nemo.megatron._apply_precision_config(model_cfg, policy, dtype)
    assert model_cfg.fp16 is True and model_cfg.bf16 is False and str(model_cfg.params_dtype) == "torch.float16"
    nemo.megatron._validate_dtype_config(dtype, model_cfg, SimpleNamespace(**policy["megatron_cfg"]["optimizer"]))


def test_fp16_on_the_dtensor_worker_says_it_has_no_loss_scaler(nemo, hook, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=nemo_precision.__name__):
        setup(nemo, master_config(nemo, recipe(tmp_path, FP16)))
    (message,) = [r.getMessage() for r in caplog.records if r.name == nemo_precision.__name__]
    assert "no loss scaler" in message and "policy.megatron_cfg.enabled" in message


# ----------------------------------------------------------------- refusals


@pytest.mark.parametrize("override", ["policy.precision=bfloat16", "policy.generation.vllm_cfg.precision=bfloat16"])
def test_a_contradicting_value_on_nemos_command_line_is_refused_by_name(nemo, hook, tmp_path, override):
    key, value = override.split("=")
    config = master_config(nemo, recipe(tmp_path, FP16), override)
    with mock.patch.multiple(nemo.grpo, **{name: mock.DEFAULT for name in GPU_SIDE}) as mocks:
        with pytest.raises(ValueError, match=rf"^{key}='{value}' contradicts loss_fn\.rollout_correction\.precision="
                                             r"'fp16'.*drop the .* override, or set loss_fn\.rollout_correction\."
                                             r"precision to the dtype you want on both sides"):
            nemo.grpo.setup(config, None, [1, 2, 3] * 10, None)
    assert not any(mocks[name].called for name in ("RayVirtualCluster", "Policy", "VllmGeneration"))


def test_a_model_type_vllm_refuses_in_fp16_is_refused_by_name_at_setup(nemo, hook, tmp_path):
    """vLLM's engine refuses glm4 in float16 when it builds (its words, from its own check); setup names it first."""
    from vllm.config.model import _check_valid_dtype

    with pytest.raises(ValueError) as vllms:
        _check_valid_dtype("glm4", torch.float16)
    model = tmp_path / "glm4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "glm4"}))
    config = master_config(nemo, recipe(tmp_path, FP16), f"policy.model_name={model}")
    with pytest.raises(ValueError) as refused:
        setup(nemo, config)
    assert str(refused.value) == (
        f"loss_fn.rollout_correction.precision: 'fp16' with policy.model_name of model type 'glm4', which vLLM "
        f"refuses in float16 ({str(vllms.value).split('Reason: ', 1)[1]}); keep precision bf16 (or null) for this "
        "model")


def test_an_fp8_rollout_engine_is_refused_with_the_flag(nemo, hook, tmp_path):
    config = master_config(nemo, recipe(tmp_path, FP16 + textwrap.dedent("""
        policy:
          generation:
            vllm_cfg:
              precision: fp8
        """)))
    with pytest.raises(ValueError, match=r"policy\.generation\.vllm_cfg\.precision='fp8' contradicts"):
        setup(nemo, config)


# ----------------------------------------------------------------- the warning without the flag


@pytest.mark.parametrize("block", [True, False])
def test_one_side_set_without_the_flag_is_warned_once_naming_both(nemo, hook, tmp_path, caplog, block):
    one_sided = """
    policy:
      precision: bfloat16
      generation:
        vllm_cfg:
          precision: float16
    """
    path = recipe(tmp_path, textwrap.dedent(one_sided), block=block)
    with caplog.at_level(logging.WARNING, logger=nemo_precision.__name__):
        mocks, out = setup(nemo, master_config(nemo, path))
        setup(nemo, master_config(nemo, path))
    (message,) = [r.getMessage() for r in caplog.records if r.name == nemo_precision.__name__]
    assert "policy.precision='bfloat16'" in message and "policy.generation.vllm_cfg.precision='float16'" in message
    assert "`rollout-parity doctor` measures what it costs" in message and "p/mixed" in message
    # warned, never refused or changed: NeMo RL builds its workers with the recipe's values
    assert mocks["Policy"].call_args.kwargs["config"]["precision"] == "bfloat16"
    assert mocks["VllmGeneration"].call_args.kwargs["config"]["vllm_cfg"]["precision"] == "float16"


def test_matching_sides_without_the_flag_say_nothing(nemo, hook, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=nemo_precision.__name__):
        setup(nemo, master_config(nemo, recipe(tmp_path)))
    assert not [r for r in caplog.records if r.name == nemo_precision.__name__]


# ----------------------------------------------------------------- the recipe helper


def test_the_recipe_helper_puts_the_dtype_where_nemo_reads_it(nemo, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    assert "precision" not in nemo_rl_generation_config()["policy"]
    policy = nemo_rl_generation_config(precision="fp16")["policy"]
    assert policy["precision"] == policy["generation"]["vllm_cfg"]["precision"] == "float16"
    assert "dtype" not in policy["generation"]["vllm_kwargs"]  # NeMo RL passes dtype= itself
    kwargs = engine_kwargs(nemo, monkeypatch, policy["generation"])
    assert kwargs["dtype"] == "float16"
    EngineArgs(**kwargs)
    with pytest.raises(ValueError, match="vllm_kwargs has \\['dtype'\\]"):
        nemo_rl_generation_config(dtype="float16")  # without the flag a dtype kwarg is NeMo RL's duplicate


# ----------------------------------------------------------------- rollout-parity launch, a fresh process

RUN_GRPO = '''
import argparse
from unittest import mock
from omegaconf import OmegaConf
from nemo_rl.algorithms import grpo
from nemo_rl.algorithms.grpo import MasterConfig, setup
from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers

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
    setup(config, None, [1, 2, 3] * 10, None)
'''
BOOT = '''
import sys
from integration_tests.support.nemo_anchor import ANCHORS
from rollout_parity.cli import main
with ANCHORS.activate(sys.argv[1]):
    sys.exit(main(sys.argv[2:]))
'''


def test_rollout_parity_launch_refuses_a_contradicting_command_line_value(tmp_path):
    """The user's command: the hook records NeMo RL's own Hydra overrides, and ``grpo.setup()`` refuses the
    one that contradicts the recipe's flag before any worker is built."""
    version = VERSIONS[-1]
    skip_unless_available([version])
    (tmp_path / "run_grpo.py").write_text(RUN_GRPO)
    path = recipe(tmp_path, FP16 + f"logger:\n  log_dir: {tmp_path}\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", BOOT, version, "launch", "run_grpo.py", "--config", str(path),
                             "policy.precision=bfloat16"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode != 0
    assert ("policy.precision='bfloat16' contradicts loss_fn.rollout_correction.precision='fp16'"
            in result.stderr), result.stderr[-3000:]
