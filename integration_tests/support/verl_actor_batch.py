"""Test support: the batch, the overrides and the independent reference of a one-update run of verl's own FSDP
actor on CPU (``verl_actor_step_cpu.py``, ``verl_actor_step_precision.py``).

The batch is four random sequences in verl's nested layout (what verl's agent loop and driver put into the
TransferQueue); the reference is an independent HF copy updated with the core's ``compute_correction`` +
``policy_loss`` by plain SGD, against which verl's own update (``train_mini_batch`` -> FSDP2 -> ``ppo_loss`` ->
our wrapper -> verl's optimizer) is compared.
"""

from __future__ import annotations

from typing import Any, Optional

LR = 0.5
PROMPT_LENS = [3, 5, 2, 4]
RESPONSE_LENS = [6, 2, 7, 4]
#: Sequences 0 and 2 far off (sum K3 ~0.03, rejected by the preset's 1e-3), 1 and 3 near parity (~1e-4, kept):
#: every batch seed both rejects and trains, where one mismatch for all let a seed reject the whole batch.
ROLLOUT_NOISE = [0.1, 0.01, 0.1, 0.01]
ADVANTAGES = [1.0, -0.7, 0.4, -1.2]


def actor_overrides(path: str) -> list[str]:
    """verl's ``ppo_trainer`` overrides of a small CPU actor: FSDP2, SGD at ``LR``, no clip/KL/entropy terms, one
    log-prob micro-batch (one hidden capture)."""
    return [
        f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false",
        "actor_rollout_ref.actor.optim.optimizer=SGD", f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.actor.optim.clip_grad=1e9",
        "actor_rollout_ref.actor.entropy_coeff=0", "actor_rollout_ref.actor.use_kl_loss=false",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={len(PROMPT_LENS)}"]


def start_process(port: str) -> None:
    """verl's CPU platform and a one-rank gloo environment (verl picks its platform once per process)."""
    import os

    from .verl_cpu import ENV, install

    os.environ.update(ENV)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", port))
    install()


class Batch:
    """The sequences, the response mask and verl's nested inputs built from them."""

    def __init__(self, vocab_size: int, generator: Any):
        import torch

        self.seqs = [torch.randint(0, vocab_size, (p + r,), generator=generator)
                     for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
        self.B, self.T, self.L = len(self.seqs), max(RESPONSE_LENS), RESPONSE_LENS
        self.mask = (torch.arange(self.T)[None] < torch.tensor(self.L)[:, None]).float()
        self.valid = self.mask.bool()

    @staticmethod
    def nested(rows: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        return tu.nested_tensor_from_tensor_list(list(rows))

    def inputs(self) -> dict:
        import torch

        nested, seqs, mask, L = self.nested, self.seqs, self.mask, self.L
        return {"input_ids": nested(seqs), "position_ids": nested(torch.arange(len(s)) for s in seqs),
                "attention_mask": nested(torch.ones(len(s), dtype=torch.long) for s in seqs),
                "prompts": nested(s[:p] for s, p in zip(seqs, PROMPT_LENS)),
                "responses": nested(s[p:] for s, p in zip(seqs, PROMPT_LENS)),
                "loss_mask": nested(mask[i, :L[i]].long() for i in range(self.B)),
                "response_mask": nested(mask[i, :L[i]].long() for i in range(self.B))}

    def log_prob_data(self) -> Any:
        from verl.utils import tensordict_utils as tu

        return tu.get_tensordict(self.inputs(), non_tensor_dict={
            "temperature": 1.0, "compute_loss": False, "calculate_entropy": False, "global_token_num": None})

    def padded(self, nested_logprobs: Any) -> Any:
        """verl's per-response log-probs as a (B, T) tensor, zero past each response."""
        import torch
        from verl.workers.utils.padding import response_from_nested

        lp = response_from_nested(nested_logprobs, self.inputs()["response_mask"])
        return torch.nested.to_padded_tensor(lp, 0.0, output_size=(self.B, self.T))

    def head_fp64(self, hidden: Any, weight: Any) -> Any:
        """The head in fp64 over the very hidden states verl's pass produced (one padded row per sequence:
        use_remove_padding=false), with ``weight`` as FSDP handed it to the forward."""
        import torch

        flat = torch.cat([hidden[i, :len(s)] for i, s in enumerate(self.seqs)]).double()
        lp_flat = torch.log_softmax(flat @ weight.detach().double().T, -1)
        ids = torch.cat([torch.roll(s, -1) for s in self.seqs])
        lp_flat = lp_flat.gather(-1, ids[:, None]).squeeze(-1)
        starts = torch.tensor([0] + [len(s) for s in self.seqs]).cumsum(0)
        out = torch.zeros(self.B, self.T, dtype=torch.float64)
        for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
            out[i, :r] = lp_flat[starts[i] + p - 1: starts[i] + p - 1 + r]
        return out

    def response_logprobs(self, model: Any, autocast_dtype: Optional[Any]) -> Any:
        """An HF model's log-probs of the responses, under ``autocast_dtype`` (None: no autocast, in fp64)."""
        import torch

        rows = []
        with torch.autocast(device_type="cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            for ids_, p, r in zip(self.seqs, PROMPT_LENS, RESPONSE_LENS):
                logits = model(input_ids=ids_.unsqueeze(0)).logits[0]
                logits = logits.to(torch.float64 if autocast_dtype is None else torch.float32)
                lp = torch.log_softmax(logits[p - 1:p + r - 1], -1).gather(-1, ids_[p:p + r].unsqueeze(-1)).squeeze(-1)
                rows.append(torch.nn.functional.pad(lp, (0, self.T - r)))
        return torch.stack(rows)

    def train(self, worker: Any, cfg: Any, old: Any, generator: Any) -> tuple:
        """One update of verl's actor on the core's correction of ``old`` against a noisy rollout;
        returns ``(correction, advantages, verl's metrics)``."""
        import torch
        from verl.utils import tensordict_utils as tu

        from rollout_parity import compute_correction

        B, L, nested, mask = self.B, self.L, self.nested, self.mask
        rollout = old + torch.randn(B, self.T, generator=generator) * torch.tensor(ROLLOUT_NOISE)[:, None]
        advantages = torch.tensor(ADVANTAGES)
        correction = compute_correction(cfg, old_logprobs=old, rollout_logprobs=rollout, response_mask=mask)
        data = tu.get_tensordict({  # the layout verl's agent loop + driver put into the TransferQueue
            **self.inputs(),
            "response_mask": nested(correction.mask[i, :L[i]].long() for i in range(B)),
            "old_log_probs": nested(old[i, :L[i]] for i in range(B)),
            "rollout_log_probs": nested(rollout[i, :L[i]] for i in range(B)),
            "advantages": nested(advantages[i] * mask[i, :L[i]] for i in range(B)),
            "rollout_is_weights": nested(correction.weights[i, :L[i]] for i in range(B)),
        }, non_tensor_dict={"temperature": 1.0, "mini_batch_size": B, "epochs": 1, "global_batch_size": B,
                            "seed": 1, "calculate_entropy": False, "dataloader_kwargs": {"shuffle": False}})
        output = worker.train_mini_batch(data)
        metrics = {k: float(v[0]) if isinstance(v, list) else float(v)
                   for k, v in tu.get(output, "metrics").items() if not isinstance(v, dict)}
        return correction, advantages, metrics

    def core_update(self, reference: Any, cfg: Any, current: Any, old: Any, advantages: Any, correction: Any,
                    actor_config: Any) -> Any:
        """The core's loss on the reference's log-probs, one plain SGD step at ``LR``; returns the loss."""
        import torch

        from rollout_parity import policy_loss

        loss, _ = policy_loss(cfg, current_logprobs=current, old_logprobs=old, advantages=advantages,
                              correction=correction, clip_ratio=actor_config.clip_ratio,
                              clip_ratio_c=actor_config.clip_ratio_c, loss_agg_mode=actor_config.loss_agg_mode,
                              global_num_tokens=float(self.mask.sum()), global_num_seqs=float(self.B))
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= LR * p.grad
        return loss


def update_vectors(module: Any, reference: Any, initial: Any) -> tuple:
    """(verl's update, the reference's update), each flattened over every parameter, from the same start."""
    import torch

    trained = dict(module.named_parameters())
    ours, theirs = [], []
    for (name, expected), start in zip(reference.named_parameters(), initial.parameters()):
        got = trained[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        ours.append((got.detach().float() - start.detach()).flatten())
        theirs.append((expected.detach() - start.detach()).flatten())
    return torch.cat(ours), torch.cat(theirs)
