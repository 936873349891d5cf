"""v0.7 ``ClippedPGLossConfig`` (keys and defaults) and the ``ClippedPGLossDataDict`` keys.

Only the schema: the loss itself is not reproduced here (the adapter test re-implements the
three truncated-IS formulas naively, in the test module).
"""

from typing import Optional

from pydantic import BaseModel


class ClippedPGLossConfig(BaseModel, extra="allow"):
    disable_ppo_ratio: bool = False
    token_level_loss: bool = True
    sequence_level_importance_ratios: bool = False
    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    ratio_clip_c: Optional[float] = None
    reference_policy_kl_penalty: float = 0.01
    reference_policy_kl_type: str = "k3"
    kl_input_clamp_value: Optional[float] = 20.0
    kl_output_clamp_value: Optional[float] = 10.0
    use_kl_in_reward: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[str] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None
    use_on_policy_kl_approximation: bool = False
    force_on_policy_ratio: bool = False
    use_cispo: bool = False
    positive_example_nll_weight: float = 0.0


# ClippedPGLossDataDict (a TypedDict in NeMo RL): every tensor is (B, S) except sample_mask (B,).
CLIPPED_PG_DATA_KEYS = ("input_ids", "advantages", "prev_logprobs", "generation_logprobs",
                        "reference_policy_logprobs", "token_mask", "sample_mask")
