"""Which SGLang release has what: the table the SGLang recipe and the adapters consult before anything loads.

Each capability the recipe emits or a flag needs is listed with the first SGLang release that has it, read from
the sources of every SGLang 0.5.x release on PyPI (0.5.0rc0 to 0.5.23; docs/compat_sglang.md). A flag that needs a
capability the installed SGLang lacks is refused by name with :class:`SglangFeatureMissingError`, naming the release
that has it, before a model or an engine is built.

SGLang's releases carry ``.postN`` tags that change what a release has (``rl_on_policy_target`` came in 0.5.4.post1),
so versions compare with their post number. Read from the installed distribution's metadata, never by import.
"""

from __future__ import annotations

import re
from typing import Optional

from rollout_parity.core.versions import module_or_installed_version
from rollout_parity.engines.spec import EngineFeature, EngineFeatureMissingError, feature_holds, missing_feature_message
from rollout_parity.registry import unit

__all__ = ["SglangFeature", "SGLANG_FEATURES", "SUPPORTED_SGLANG", "SGLANG_DISTRIBUTIONS", "SglangFeatureMissingError",
           "installed_sglang_version", "parse_sglang_version", "sglang_has", "require_sglang_feature"]

#: The SGLang releases the recipe is tested with: verl 0.9.1's and NeMo RL's pin (0.5.12) to the newest (0.5.23).
SUPPORTED_SGLANG = ">=0.5.12,<0.5.24"
#: The distributions that install the ``sglang`` package.
SGLANG_DISTRIBUTIONS = unit("sglang").distributions


#: One SGLang capability (the seam's record: its first release, what it does, our options that need it).
SglangFeature = EngineFeature


_FEATURES = (
    SglangFeature("enable_fp32_lm_head", "0.5.3", "the `enable_fp32_lm_head` server argument (the head in float32)",
                  ("fp32_lm_head=True",)),
    SglangFeature("fp32_head_out_dtype", "0.5.18", "the fp32 head as one matmul of the bf16 operands with float32 "
                  "output on CUDA (older releases upcast the weight to float32 on every forward)"),
    SglangFeature("disable_overlap_schedule", "0.5.0rc0", "the `disable_overlap_schedule` server argument (one "
                  "fixed execution path, as vLLM's async_scheduling=False)", ("the parity recipe",)),
    SglangFeature("enable_deterministic_inference", "0.5.3", "the `enable_deterministic_inference` server argument"),
    SglangFeature("return_routed_experts", "0.5.7", "each token's routed experts (`enable_return_routed_experts`, "
                  "`meta_info['routed_experts']`)", ("moe_routing_replay=True",)),
    SglangFeature("routed_experts_base64", "0.5.10", "`meta_info['routed_experts']` as base64 int32 whatever the "
                  "tokenizer setting (0.5.7-0.5.9: a tensor when skip_tokenizer_init)"),
    SglangFeature("logprobs_full_vocabulary", "0.5.9", "logprobs over the full vocabulary with min_p on the "
                  "flashinfer sampler (up to 0.5.8.post1 they were renormalised over top-k/top-p there)"),
    SglangFeature("return_sampling_mask", "0.5.16", "each sampled token's kept set (`return_sampling_mask` on the "
                  "request, `meta_info['output_token_sampling_mask']`; needs a finite top_k)",
                  ("rollout_sampling_replay=True",)),
    SglangFeature("resolve_once", "0.5.19", "`ServerArgs.resolve_once()` (older releases resolve in __post_init__)"),
    SglangFeature("server_args_struct", "0.5.20", "`ServerArgs` as a msgspec Struct (`dataclasses.fields` refuses "
                  "it)"),
    SglangFeature("weight_update_session", "0.5.21", "`begin_weight_update()` / `end_weight_update()`, required "
                  "around `update_weights_from_tensor`"),
)
#: name -> :class:`SglangFeature`.
SGLANG_FEATURES: dict[str, SglangFeature] = {f.name: f for f in _FEATURES}


class SglangFeatureMissingError(EngineFeatureMissingError):
    """The installed SGLang lacks a setting or capability that an option needs."""


def parse_sglang_version(text: str) -> tuple[int, int, int, int, int]:
    """``"0.5.4.post1"`` -> ``(0, 5, 4, 1, 1)``; ``"0.5.0rc2"`` -> ``(0, 5, 0, -1, 2)`` (a release candidate sorts
    before its release, a post release after it; a local tag such as ``+cpu`` is dropped)."""
    m = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:(rc|\.?post)(\d+))?", str(text))
    if not m:
        raise ValueError(f"cannot parse an SGLang version from {text!r}")
    major, minor, patch = (int(x or 0) for x in m.group(1, 2, 3))
    tag, number = m.group(4), int(m.group(5) or 0)
    kind = -1 if tag == "rc" else 1 if tag else 0
    return major, minor, patch, kind, number


def installed_sglang_version() -> Optional[str]:
    """The installed SGLang version, or None."""
    return module_or_installed_version("sglang", SGLANG_DISTRIBUTIONS)


def sglang_has(feature: str, version: Optional[str]) -> bool:
    """Whether SGLang ``version`` has ``feature``. ``version=None`` (no SGLang here: settings for an engine
    elsewhere) assumes the newest release."""
    return feature_holds("SGLang", SGLANG_FEATURES, feature, version, parse_sglang_version)


def require_sglang_feature(feature: str, version: Optional[str], *, option: str) -> None:
    """Raise :class:`SglangFeatureMissingError` when SGLang ``version`` lacks ``feature``, which ``option`` needs."""
    if sglang_has(feature, version):
        return
    raise SglangFeatureMissingError(missing_feature_message("SGLang", SGLANG_FEATURES[feature], version, option))
