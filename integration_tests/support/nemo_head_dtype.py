"""The dtype NeMo RL's DTensor policy worker computes the lm_head in, with NeMo RL's own code.

``python -m integration_tests.support.nemo_head_dtype VERSION`` (one gloo rank on CPU) takes a tiny
Qwen2 loaded in fp32 as the worker loads it (master weights in fp32), shards it with NeMo RL's
``models/dtensor/parallelize.py`` ``_parallelize_model(param_dtype=bfloat16)`` as
``DTensorPolicyWorker.__init__`` does, and runs a forward under ``torch.autocast(dtype=bfloat16)``
as its ``get_logprobs`` and ``train`` do (``device_type="cuda"`` there, ``"cpu"`` here: the same
autocast rule for ``linear``). It prints, as JSON, the dtypes the ``lm_head`` saw and returned and
the largest difference of the logits from an fp32 head's on the same hidden states.
"""

from __future__ import annotations

import json
import os
import sys


def main(version: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from integration_tests.support.nemo_anchor import ANCHORS
    from integration_tests.support.processes import free_port
    from rollout_parity.testing.tiny_model import build_tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with ANCHORS.activate(version) as ns:
            parallelize = ns.load("nemo_rl.models.dtensor.parallelize")
            model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), dtype=torch.float32)
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
            dp_cp = mesh[("dp", "cp")]._flatten(mesh_dim_name="dp_cp")
            model = parallelize._parallelize_model(model, dp_cp, mesh["tp"], param_dtype=torch.bfloat16,
                                                   sequence_parallel=False, cpu_offload=False,
                                                   activation_checkpointing=False, custom_parallel_plan=None)
            seen: dict = {}

            def record(module, inputs, output):
                seen.update(weight=str(module.weight.dtype), hidden=str(inputs[0].dtype), logits=str(output.dtype),
                            hidden_value=inputs[0].detach().float(), output_value=output.detach().float(),
                            weight_value=module.weight.detach().float())

            model.lm_head.register_forward_hook(record)
            with torch.no_grad(), torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                model(torch.tensor([[3, 14, 15, 92, 65, 35]]))
            fp32 = seen.pop("hidden_value") @ seen.pop("weight_value").T
            seen["max_abs_diff_from_fp32_head"] = float((seen.pop("output_value") - fp32).abs().max())
            print(json.dumps(seen))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
