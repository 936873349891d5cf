"""verl adapter: the shared correction flags inside ``python -m verl.trainer.main_ppo``.

Usage (after ``pip install rollout-parity[verl]``): add the shared flags of DESIGN.md as
Hydra overrides to an existing verl command line, e.g.
``+rollout_parity.rollout_importance_sampling_mode=token_truncate``. The adapter hooks
into verl through its own extension points only (no fork):

* **Start-up** (main process). Importing this module wraps ``verl.utils.config.validate_config``
  (what ``main_ppo.main`` calls before Ray starts). The module is imported there by verl's
  ``verl.plugins`` entry point (declared by this package) or by
  ``VERL_USE_EXTERNAL_MODULES=rollout_parity.adapters.verl``. When the config has a
  ``rollout_parity`` block, :func:`configure_verl` validates it into a ``CorrectionConfig``
  (a bad flag fails here, before any GPU work) and rewrites the verl config:
  ``actor_rollout_ref.actor.policy_loss.loss_mode=rollout_parity``,
  ``actor_rollout_ref.model.external_lib`` += this module (so every worker and the V1
  driver import it), ``rollout.calculate_log_probs=true``, the vLLM parity recipe merged
  into ``actor_rollout_ref.rollout.engine_kwargs.vllm``, and the validated flags as JSON
  in ``ray_kwargs.ray_init.runtime_env.env_vars.ROLLOUT_PARITY_VERL_CONFIG`` (how they
  reach every Ray actor: verl's ``ActorConfig`` is a closed dataclass).
* **Policy loss** (workers): ``register_policy_loss("rollout_parity")`` at import.
* **Driver** (decoupled mode): verl's own ``compute_rollout_correction_and_add_to_batch``
  is wrapped. It runs in ``_compute_advantage`` *before* the advantages, so our rejected
  tokens leave ``response_mask``; our IS weights go into the batch's ``rollout_is_weights``.
  verl 0.9.1's outcome estimators (GRPO, RLOO) ignore the mask when they sum
  ``token_level_rewards`` and group rows by ``uid`` (verl#6362, verl#6452), so the hook also
  masks those rewards and gives a fully rejected row a uid of its own: rejected tokens and
  sequences leave the group baselines too. Without our flags the original runs.
* **fp32 lm_head** (workers): ``FSDPEngine._build_module`` is wrapped so
  ``apply_fp32_lm_head`` runs on the loaded HF model before LoRA/QAT and FSDP wrapping.
Every patch keeps its original, is marked, is idempotent, and :func:`uninstall` restores it.

**pi_old and the missing rollout logprobs.** verl 0.9.1's ``ppo_loss``
(verl/workers/utils/losses.py) hands a custom loss only ``old_log_prob``, ``log_prob``,
``advantages``, ``response_mask`` and ``rollout_is_weights``; ``rollout_log_probs`` never
reaches it. We design around that:

* ``old_logprob_source: recompute`` (verl "decoupled"): everything that needs the rollout
  logprobs (IS weights, rejection, the rollout-side diagnostics) is computed once per
  batch on the driver, where ``old_log_probs`` and ``rollout_log_probs`` sit side by side,
  and travels to the loss through the two tensors verl does pass: ``rollout_is_weights``
  and ``response_mask``. The loss multiplies by the weights and uses the mask; it adds
  the policy-side metrics (``policy/*``, ``loss_contrib_pos/neg`` = C(r_ppo^train)).
  The off-policy sequence mask needs π_θ and A, which exist only in the loss; there the
  behaviour policy is π_old (DESIGN.md's fallback "else π_old"), so in decoupled verl it
  guards policy drift π_old→π_θ, while the TIM part π_rollout→π_old is handled by the
  IS weights and rejection on the driver.
* ``old_logprob_source: bypass``: we switch on verl's own ``algorithm.rollout_correction.
  bypass_mode`` (with ``rollout_is``/``rollout_rs`` left null), which copies
  ``rollout_log_probs`` into ``old_log_probs``: the loss then *receives* π_rollout as
  ``old_log_prob`` and computes rejection, the off-policy mask and the diagnostics itself
  against the live π_θ, per micro-batch (as verl's own bypass loss does).

Refused: our flags together with verl's own ``algorithm.rollout_correction.rollout_is`` /
``rollout_rs`` or ``loss_mode=bypass_mode`` (the mismatch would be corrected twice), a
policy loss other than verl's default ``vanilla`` (ours is that PPO surrogate),
``loss_agg_mode=token-sum`` (not a shared mode), and a vLLM engine kwarg contradicting
the parity recipe. Known verl behaviour kept as is: V1 normalises ``token-mean`` by the
rollout's ``loss_mask`` token count, which rejection does not shrink (as for verl's own
``rollout_rs``).

Math: ../shared/DESIGN.md and the core (``rollout_parity.core``); nothing is re-implemented here.
verl's semantics we match where modes overlap are written down in docs/verl.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import logging
import os
import sys
from typing import Any, Callable, Optional

import torch

from rollout_parity.core.config import CorrectionConfig
from rollout_parity.core.correction import CorrectionOutput, compute_correction
from rollout_parity.core.loss import policy_loss

try:
    import verl  # noqa: F401
    from omegaconf import DictConfig, OmegaConf, open_dict
except ImportError as exc:  # pragma: no cover - exercised without verl installed
    raise ImportError(
        "rollout_parity.adapters.verl needs verl: pip install rollout-parity[verl]"
    ) from exc

logger = logging.getLogger(__name__)

LOSS_NAME = "rollout_parity"
CONFIG_KEY = "rollout_parity"
ENV_CONFIG = "ROLLOUT_PARITY_VERL_CONFIG"
MODULE = "rollout_parity.adapters.verl"
_PATCH_MARK = "__rollout_parity_patch__"
_METRICS_NEED_POLICY = ("loss_contrib_pos", "loss_contrib_neg", "loss_contrib_rollout_pos",
                        "loss_contrib_rollout_neg", "off_policy_masked_frac")

# ----------------------------------------------------------------------------- active config

_active: dict[str, Any] = {"raw": None, "cfg": None}


def set_active_config(cfg: Optional[CorrectionConfig]) -> None:
    """Make ``cfg`` the flags of this process (and of Ray actors started from it)."""
    if cfg is None:
        os.environ.pop(ENV_CONFIG, None)
    else:
        os.environ[ENV_CONFIG] = json.dumps(cfg.to_dict(), sort_keys=True)


def active_config() -> Optional[CorrectionConfig]:
    """The flags set by :func:`configure_verl`, read from ``ROLLOUT_PARITY_VERL_CONFIG``."""
    raw = os.environ.get(ENV_CONFIG)
    if raw != _active["raw"]:
        _active["cfg"] = None if not raw else CorrectionConfig.from_dict(json.loads(raw))
        _active["raw"] = raw
    return _active["cfg"]


def _require_config() -> CorrectionConfig:
    cfg = active_config()
    if cfg is None:
        raise RuntimeError(
            f"policy loss {LOSS_NAME!r} selected but no rollout-parity flags are set in this process "
            f"(env {ENV_CONFIG} is empty): add +{CONFIG_KEY}.<flag>=... overrides and load "
            f"{MODULE} in the main process (verl.plugins entry point or VERL_USE_EXTERNAL_MODULES={MODULE})"
        )
    return cfg


# ----------------------------------------------------------------------------- config

def correction_config_from_verl(config: Any) -> Optional[CorrectionConfig]:
    """The ``rollout_parity`` block of a verl config as a ``CorrectionConfig`` (None if absent)."""
    block = config.get(CONFIG_KEY, None) if hasattr(config, "get") else None
    if block is None:
        return None
    if isinstance(block, str) or not hasattr(block, "keys"):
        raise ValueError(f"{CONFIG_KEY}: expected a mapping of shared flags, got {block!r}")
    data = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else dict(block)
    preset = data.pop("preset", None)
    if preset is not None:
        return CorrectionConfig.preset(preset, **data)
    return CorrectionConfig.from_dict(data)


def check_no_double_correction(config: Any, cfg: CorrectionConfig) -> None:
    """Raise when verl's own rollout correction would act next to ours."""
    rc = OmegaConf.select(config, "algorithm.rollout_correction", default=None) if isinstance(config, DictConfig) \
        else (config.get("algorithm", {}) or {}).get("rollout_correction")
    if rc is not None:
        own = {k: rc.get(k) for k in ("rollout_is", "rollout_rs") if rc.get(k) is not None}
        if own:
            raise ValueError(
                f"double correction: algorithm.rollout_correction has {own} and {CONFIG_KEY} is set; "
                "use one of them (set algorithm.rollout_correction.rollout_is=null rollout_rs=null, "
                f"or drop the +{CONFIG_KEY}.* overrides)"
            )
        if rc.get("bypass_mode", False) and cfg.old_logprob_source != "bypass":
            raise ValueError(
                "algorithm.rollout_correction.bypass_mode=true contradicts "
                f"{CONFIG_KEY}.old_logprob_source={cfg.old_logprob_source!r}; "
                f"set {CONFIG_KEY}.old_logprob_source=bypass instead"
            )
    loss_mode = _select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    if loss_mode == "bypass_mode":
        raise ValueError(
            "double correction: actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode is verl's own "
            f"rollout-correction loss; with {CONFIG_KEY} use old_logprob_source=bypass"
        )
    if loss_mode not in ("vanilla", LOSS_NAME):
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r}: {CONFIG_KEY} replaces verl's "
            f"'vanilla' PPO loss with {LOSS_NAME!r} (the same surrogate, corrected); another loss cannot be combined"
        )


def _select(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, DictConfig):
        return OmegaConf.select(config, key, default=default)
    node = config
    for part in key.split("."):
        if not hasattr(node, "get"):
            return default
        node = node.get(part)
        if node is None:
            return default
    return node


def _vllm_kwargs(cfg: CorrectionConfig) -> dict[str, Any]:
    from rollout_parity.core.vllm_recipe import vllm_parity_kwargs

    return vllm_parity_kwargs(fp32_lm_head=cfg.fp32_lm_head)


def configure_verl(config: DictConfig) -> Optional[CorrectionConfig]:
    """Validate the ``rollout_parity`` block and rewrite ``config`` in place for it.

    Returns the ``CorrectionConfig`` (None, config untouched, when there is no block).
    Raises ``ValueError`` naming the flag on a bad value, on double correction, and on a
    vLLM engine kwarg that contradicts the parity recipe.
    """
    cfg = correction_config_from_verl(config)
    if cfg is None:
        return None
    check_no_double_correction(config, cfg)
    strategy = _select(config, "actor_rollout_ref.actor.strategy", None)
    if cfg.fp32_lm_head and strategy not in (None, "fsdp", "fsdp2"):
        raise ValueError(f"fp32_lm_head: supported with the FSDP actor (fsdp/fsdp2), got strategy={strategy!r}")
    loss_agg_mode = _select(config, "actor_rollout_ref.actor.loss_agg_mode", "token-mean")
    if loss_agg_mode == "token-sum":
        raise ValueError("actor_rollout_ref.actor.loss_agg_mode=token-sum is not a shared aggregation mode")

    recipe = _vllm_kwargs(cfg)
    rollout = config.actor_rollout_ref.rollout
    with open_dict(config):
        engine_kwargs = rollout.get("engine_kwargs", None)
        if engine_kwargs is None:
            rollout.engine_kwargs = {}
        if rollout.engine_kwargs.get("vllm", None) is None:
            rollout.engine_kwargs.vllm = {}
        vllm_kwargs = rollout.engine_kwargs.vllm
        for key, value in recipe.items():
            current = vllm_kwargs.get(key, None)
            if isinstance(value, dict):
                merged = dict(OmegaConf.to_container(current, resolve=True)) if current is not None else {}
                for k, v in value.items():
                    if k in merged and merged[k] != v:
                        raise ValueError(
                            f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}.{k}={merged[k]!r} contradicts "
                            f"the parity recipe ({k}={v!r})"
                        )
                    merged[k] = v
                vllm_kwargs[key] = merged
            else:
                if current is not None and current != value:
                    raise ValueError(
                        f"actor_rollout_ref.rollout.engine_kwargs.vllm.{key}={current!r} contradicts the parity "
                        f"recipe ({key}={value!r})"
                    )
                vllm_kwargs[key] = value
        # verl also passes these two from its own rollout fields; keep both views equal.
        for key in ("enable_prefix_caching", "logprobs_mode"):
            if key in recipe and key in rollout:
                rollout[key] = recipe[key]
        rollout.calculate_log_probs = True

        config.actor_rollout_ref.actor.policy_loss.loss_mode = LOSS_NAME
        model = config.actor_rollout_ref.model
        libs = model.get("external_lib", None)
        if libs is None:
            model.external_lib = MODULE
        else:
            names = [libs] if isinstance(libs, str) else list(libs)
            if MODULE not in names:
                model.external_lib = names + [MODULE]

        if cfg.old_logprob_source == "bypass":
            config.algorithm.rollout_correction.bypass_mode = True

        payload = json.dumps(cfg.to_dict(), sort_keys=True)
        if config.get("ray_kwargs", None) is None:
            config.ray_kwargs = {}
        if config.ray_kwargs.get("ray_init", None) is None:
            config.ray_kwargs.ray_init = {}
        ray_init = config.ray_kwargs.ray_init
        if ray_init.get("runtime_env", None) is None:
            ray_init.runtime_env = {}
        if ray_init.runtime_env.get("env_vars", None) is None:
            ray_init.runtime_env.env_vars = {}
        ray_init.runtime_env.env_vars[ENV_CONFIG] = payload
        config[CONFIG_KEY] = cfg.to_dict()
    set_active_config(cfg)
    # One visible line at start: a silently ignored +rollout_parity block would be the worst failure.
    print(f"[rollout-parity] verl configured: loss_mode={LOSS_NAME}, flags={payload}", flush=True)
    if cfg.off_policy_sequence_mask_delta is not None and cfg.old_logprob_source == "recompute":
        logger.warning(
            "off_policy_sequence_mask_delta in verl decoupled mode: the loss does not see rollout logprobs, "
            "so the behaviour policy of the off-policy mask is pi_old (DESIGN.md fallback)"
        )
    return cfg


def verl_equivalent(cfg: CorrectionConfig) -> dict[str, Any]:
    """verl's own ``algorithm.rollout_correction`` block with the same semantics as ``cfg``.

    Exists where the modes overlap (docs/verl.md): token TIS without a lower clamp, IcePop
    (``"lo_hi"``) for the mask modes, sequence ratios as a product, kept sequences weighted
    by ρ_seq, every rejection option. Raises ``ValueError`` naming the flag otherwise.
    """
    mode = cfg.rollout_importance_sampling_mode
    upper = cfg.rollout_importance_sampling_threshold
    lower = cfg.rollout_importance_sampling_threshold_lower
    out: dict[str, Any] = {"rollout_is": None, "rollout_is_threshold": upper, "rollout_rs": None,
                           "rollout_rs_threshold": None, "bypass_mode": cfg.old_logprob_source == "bypass",
                           "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}
    if mode is not None:
        level = "token" if mode.startswith("token") else "sequence"
        if level == "sequence" and cfg.rollout_importance_sampling_sequence_reduction != "product":
            raise ValueError("rollout_importance_sampling_sequence_reduction: verl's sequence ratio is the product")
        if mode.endswith("truncate"):
            if lower is not None:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's TIS has no lower clamp")
            threshold: Any = upper
        else:
            if lower is None or not lower > 0:
                raise ValueError("rollout_importance_sampling_threshold_lower: verl's IcePop needs a lower bound > 0")
            if mode == "sequence_mask" and cfg.rollout_importance_sampling_sequence_mask_weight != "sequence":
                raise ValueError("rollout_importance_sampling_sequence_mask_weight: verl weights kept sequences "
                                 "by rho_seq ('sequence')")
            threshold = f"{lower}_{upper}"
        out.update(rollout_is=level, rollout_is_threshold=threshold)
    if cfg.rollout_rejection is not None:
        specs = []
        for rule in cfg.rejection_rules:
            specs.append(f"{rule.lower}_{rule.upper}" if rule.estimator == "k1" else f"{rule.upper}")
        out.update(rollout_rs=",".join(cfg.rollout_rejection), rollout_rs_threshold=",".join(specs))
    if cfg.off_policy_sequence_mask_delta is not None:
        raise ValueError("off_policy_sequence_mask_delta: verl 0.9.1 has no off-policy sequence mask")
    return out


# ----------------------------------------------------------------------------- policy loss

def _global_counts(config: Any) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """verl's global normalisers as the core's: ``N_tok``, ``N_seq`` per rank, loss scale."""
    info = dict(getattr(config, "global_batch_info", None) or {}) if config is not None else {}
    dp = float(info.get("dp_size") or 1)
    tokens = info.get("batch_num_tokens")
    seqs = info.get("global_batch_size")
    # verl: sum / N_global * dp_size (DDP averages gradients over ranks); the core: sum / N.
    n_tok = None if tokens is None else float(tokens) / dp
    n_seq = None if seqs is None else float(seqs) / dp
    if n_tok is None and dp > 1:
        raise ValueError("verl global_batch_info has dp_size > 1 but no batch_num_tokens")
    return n_tok, n_seq, info.get("loss_scale_factor")


def _cfg_get(config: Any, key: str, default: Any) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def rollout_parity_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl ``PolicyLossFn`` (verl/trainer/ppo/core_algos.py signature) backed by the core.

    Decoupled: ``rollout_is_weights`` and ``response_mask`` already carry the driver's
    correction. Bypass: ``old_log_prob`` is π_rollout (verl copied it), the correction is
    computed here against the live π_θ. See the module docstring.
    """
    cfg = _require_config()
    if loss_agg_mode == "token-sum":
        raise ValueError("loss_agg_mode=token-sum is not a shared aggregation mode")
    n_tok, n_seq, scale = _global_counts(config)
    clip_ratio = float(_cfg_get(config, "clip_ratio", 0.2))
    loss_kwargs = dict(
        clip_ratio=clip_ratio,
        clip_ratio_low=_cfg_get(config, "clip_ratio_low", None),
        clip_ratio_high=_cfg_get(config, "clip_ratio_high", None),
        clip_ratio_c=float(_cfg_get(config, "clip_ratio_c", 3.0)),
        loss_agg_mode=loss_agg_mode,
        global_num_tokens=n_tok,
        global_num_seqs=n_seq,
        loss_scale_factor=scale,
    )
    current = log_prob.detach()
    if cfg.old_logprob_source == "bypass":
        correction = compute_correction(
            cfg, old_logprobs=None, rollout_logprobs=old_log_prob, response_mask=response_mask,
            advantages=advantages, current_logprobs=current,
        )
        loss, metrics = policy_loss(cfg, current_logprobs=log_prob, old_logprobs=old_log_prob,
                                    advantages=advantages, correction=correction, **loss_kwargs)
        return loss, metrics

    weights = rollout_is_weights
    if weights is None:
        weights = torch.ones_like(old_log_prob, dtype=torch.float32)
    mask = response_mask
    loss_metrics: dict[str, float] = {}
    # Policy-side part of the correction: the off-policy mask and C(r_ppo^train), with
    # π_old as the only behaviour policy the loss can see (passed as "rollout").
    policy_cfg = cfg.replace(rollout_importance_sampling_mode=None, rollout_rejection=None,
                             rollout_rejection_threshold=None)
    wants = cfg.wants_metrics
    if cfg.off_policy_sequence_mask_delta is not None or wants:
        side = compute_correction(policy_cfg, old_logprobs=old_log_prob, rollout_logprobs=old_log_prob,
                                  response_mask=response_mask, advantages=advantages, current_logprobs=current,
                                  with_metrics=wants)
        mask = side.mask
        keep = ("loss_contrib_pos", "loss_contrib_neg", "off_policy_masked_frac")
        loss_metrics = {k: v for k, v in side.metrics.items() if k.split("/", 1)[-1] in keep}
    correction = CorrectionOutput(weights=weights.detach(), mask=mask, metrics=loss_metrics,
                                  old_logprobs=old_log_prob)
    return policy_loss(cfg, current_logprobs=log_prob, old_logprobs=old_log_prob, advantages=advantages,
                       correction=correction, **loss_kwargs)


# ----------------------------------------------------------------------------- driver hook

def driver_correction(batch: Any, rollout_corr_config: Any = None) -> tuple[Any, dict[str, float]]:
    """Our correction of one batch on the driver (decoupled mode), verl's calling convention.

    ``batch`` is a ``DataProto`` with ``old_log_probs``, ``rollout_log_probs`` and
    ``response_mask``. Writes the corrected ``response_mask`` and, when an IS mode is set,
    ``rollout_is_weights``; returns ``(batch, metrics)``.
    """
    cfg = _require_config()
    if rollout_corr_config is not None:
        check_no_double_correction({"algorithm": {"rollout_correction": rollout_corr_config}}, cfg)
    tensors = batch.batch
    response_mask = tensors["response_mask"]
    driver_cfg = cfg.replace(off_policy_sequence_mask_delta=None)
    with torch.no_grad():
        out = compute_correction(driver_cfg, old_logprobs=tensors["old_log_probs"],
                                 rollout_logprobs=tensors["rollout_log_probs"], response_mask=response_mask)
    tensors["response_mask"] = out.mask
    if cfg.rollout_importance_sampling_mode is not None:
        tensors["rollout_is_weights"] = out.weights.to(torch.float32)
    if cfg.rollout_rejection is not None:
        _keep_rejected_out_of_baselines(batch, response_mask, out.mask)
    metrics = {k: v for k, v in out.metrics.items() if k.split("/", 1)[-1] not in _METRICS_NEED_POLICY}
    return batch, metrics


def _keep_rejected_out_of_baselines(batch: Any, before: torch.Tensor, after: torch.Tensor) -> None:
    """Make verl's outcome estimators ignore what rejection removed (verl#6362, verl#6452).

    verl 0.9.1's GRPO/RLOO sum ``token_level_rewards`` without the mask and group rows by
    ``uid``, so a masked reward token, or a fully rejected sibling, still moves the baseline
    of the accepted responses. Rewards are masked with the corrected mask, and a fully
    rejected row gets a uid of its own (it trains nothing: its mask is all zero).
    """
    tensors = batch.batch
    if "token_level_rewards" in tensors.keys():
        rewards = tensors["token_level_rewards"]
        tensors["token_level_rewards"] = rewards * after.to(rewards.dtype)
    uids = getattr(batch, "non_tensor_batch", {}).get("uid")
    if uids is not None:
        dropped = (before.bool().any(dim=-1) & ~after.bool().any(dim=-1)).tolist()
        if any(dropped):
            uids = uids.copy()
            for i, gone in enumerate(dropped):
                if gone:
                    uids[i] = f"{uids[i]}#rollout_parity_rejected_{i}"
            batch.non_tensor_batch["uid"] = uids


def _wrap_helper(original: Callable) -> Callable:
    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, rollout_corr_config):
        if active_config() is None:
            return original(batch, rollout_corr_config)
        return driver_correction(batch, rollout_corr_config)

    setattr(compute_rollout_correction_and_add_to_batch, _PATCH_MARK, original)
    return compute_rollout_correction_and_add_to_batch


def _wrap_validate(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        configure_verl(config)
        return original(config, *args, **kwargs)

    setattr(validate_config, _PATCH_MARK, original)
    return validate_config


def _wrap_build_module(original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_module(self, *args, **kwargs):
        module = original(self, *args, **kwargs)
        cfg = active_config()
        if cfg is not None and cfg.fp32_lm_head and getattr(self.model_config, "model_type", None) == "language_model":
            from rollout_parity.core.fp32_head import apply_fp32_lm_head

            apply_fp32_lm_head(module)
        return module

    setattr(_build_module, _PATCH_MARK, original)
    return _build_module


# (module, attribute, wrapper factory); a module not importable in this verl is skipped.
_PATCH_POINTS: tuple[tuple[str, str, Callable], ...] = (
    ("verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch", _wrap_helper),
    ("verl.trainer.ppo.v1.trainer_base", "compute_rollout_correction_and_add_to_batch", _wrap_helper),
    ("verl.utils.config", "validate_config", _wrap_validate),
    ("verl.trainer.main_ppo", "validate_config", _wrap_validate),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine._build_module", _wrap_build_module),
)
_applied: list[tuple[Any, str, Any]] = []


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Re-runs ``install`` right after a skipped patch point's module is imported for real.

    verl imports its plugins from ``verl/__init__`` (the ``verl.plugins`` entry point), when
    some patch points cannot import yet: the FSDP engine needs the device platform, which a
    process may register only after ``import verl``. A patch that could not be applied then
    is applied as soon as its module loads, not lost.
    """

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                self.pending.discard(fullname)
                original_exec = spec.loader.exec_module

                def exec_module(module, _original=original_exec):
                    _original(module)
                    install(import_missing=False)

                spec.loader.exec_module = exec_module
                return spec
        return None


_post_import = _PatchAfterImport()


def _resolve(module_name: str, attr: str, import_missing: bool) -> tuple[Any, str] | None:
    if module_name not in sys.modules and not import_missing:
        return None
    try:
        owner = __import__(module_name, fromlist=["_"])
    except Exception as exc:  # an optional verl part (e.g. no ray) must not break the others
        logger.debug("rollout-parity: patch point %s.%s deferred until it imports (%s)", module_name, attr, exc)
        _post_import.pending.add(module_name)
        if _post_import not in sys.meta_path:
            sys.meta_path.insert(0, _post_import)
        return None
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def install(import_missing: bool = True) -> None:
    """Register the policy loss and apply every patch (idempotent)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    if POLICY_LOSS_REGISTRY.get(LOSS_NAME) is not rollout_parity_policy_loss:
        register_policy_loss(LOSS_NAME)(rollout_parity_policy_loss)
    for module_name, attr, factory in _PATCH_POINTS:
        # main_ppo is patched only when already imported (it pulls in ray and hydra's app).
        resolved = _resolve(module_name, attr, import_missing and module_name != "verl.trainer.main_ppo")
        if resolved is None:
            continue
        owner, name = resolved
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is None or hasattr(current, _PATCH_MARK):
            continue
        setattr(owner, name, factory(current))
        _applied.append((owner, name, current))


def uninstall() -> None:
    """Restore every patched attribute and drop the registered loss."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    while _applied:
        owner, name, original = _applied.pop()
        setattr(owner, name, original)
    _post_import.pending.clear()
    if _post_import in sys.meta_path:
        sys.meta_path.remove(_post_import)
    if POLICY_LOSS_REGISTRY.get(LOSS_NAME) is rollout_parity_policy_loss:
        del POLICY_LOSS_REGISTRY[LOSS_NAME]


def is_installed() -> bool:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    return POLICY_LOSS_REGISTRY.get(LOSS_NAME) is rollout_parity_policy_loss and bool(_applied)


install()
