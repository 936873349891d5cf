"""One rank of the 2-rank TRL run on the shared batch (``python -m torch.distributed.run --nproc_per_node 2``).

Each rank builds a real ``GRPOTrainer`` (accelerate's multi-CPU state, gloo), takes its half of the
shared cross-framework batch (rows ``rank * B/2 ...``) through TRL's generation and loss with the
adapter applied (``rollout_parity/check/trl_batch.py``: TRL's collectives, ``num_items_in_batch`` gathered over
ranks, our all-reduced rejection count and metrics), and writes its loss, gradient and metrics to
``<out_dir>/rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: The configurations and TRL loss types the 2-rank run covers (shared with the test).
CONFIGS = ("tis_srs_k3", "trl_default", "k1_k2_rejection", "off_policy_mask", "metrics_only")
LOSS_TYPES = ("dapo", "grpo")


def main(out_dir: str) -> None:
    from rollout_parity.check.shared_batch import B, T, config_for, make_shared_batch
    from rollout_parity.check.trl_batch import pretend_vllm_trainer, through_trl
    from rollout_parity.adapters import trl as trl_adapter

    trainer = pretend_vllm_trainer(out_dir, B // 2, T)
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    assert world == 2, f"expected 2 ranks, got {world}"
    batch = make_shared_batch()
    results = {}
    for name in CONFIGS:
        cfg = config_for(name)
        trainer.vllm_importance_sampling_correction = cfg.changes_loss  # diagnostics only: TRL's own ratio off
        for loss_type in LOSS_TYPES:
            loss, grad, metrics, _ = through_trl(trainer, cfg, loss_type, batch, row_offset=rank * (B // 2),
                                                 n_rows=B // 2)
            results[f"{name}/{loss_type}"] = {"loss": loss.item(), "grad": grad.tolist(), "metrics": metrics}
            trl_adapter.revert(trainer)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
