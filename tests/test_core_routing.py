"""``core.routing``'s placement of engine routes on a padded batch and its device-side lookup by tokens, against
a naive per-row reference (the dict of token tuples and the per-row ``nonzero`` placement the core replaced)."""

from __future__ import annotations

import pytest
import torch

from rollout_parity.core.routing import RouteTable, align_routes

L, K = 3, 2


def naive_align(rows, mask):
    """Row i's routes at the first n_i positions where mask[i] is 1, in order; -1 elsewhere."""
    out = torch.full((*mask.shape, L, K), -1, dtype=torch.int16)
    for i, row in enumerate(rows):
        if row is None:
            continue
        positions = [p for p in range(mask.shape[1]) if mask[i, p]]
        for j, p in enumerate(positions[:len(row)]):
            out[i, p] = torch.as_tensor(row[j]).to(torch.int16)
    return out


def _case(g, batch, width):
    mask = (torch.rand(batch, width, generator=g) > 0.3).long()
    seqs = [torch.randint(0, 4, (int(mask[i].sum()),), generator=g).tolist() for i in range(batch)]
    ids = torch.zeros(batch, width, dtype=torch.long)
    for i in range(batch):
        ids[i, mask[i].bool()] = torch.tensor(seqs[i], dtype=torch.long)
    return mask, seqs, ids


@pytest.mark.parametrize("seed", range(40))
def test_align_routes_and_the_table_match_the_naive_placement(seed):
    g = torch.Generator().manual_seed(seed)
    batch, width = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
    mask, seqs, ids = _case(g, batch, width)
    rows = [None if torch.rand(1, generator=g) < 0.2 else
            torch.randint(0, 8, (int(torch.randint(0, width + 3, (1,), generator=g)), L, K), generator=g)
            for _ in range(batch)]
    assert torch.equal(align_routes(rows, mask, L, K), naive_align(rows, mask))
    # The engine generated some of the rows (a few twice, with other routes: the last one counts, as in a dict).
    generated = [i for i in range(batch) if torch.rand(1, generator=g) < 0.7]
    generated += generated[:1]
    routes = [torch.randint(0, 8, (max(len(seqs[i]) - 1, 0), L, K), generator=g) for i in generated]
    by_tokens = {tuple(seqs[i]): r for i, r in zip(generated, routes)}
    table = RouteTable([seqs[i] for i in generated], routes, L, K)
    want = naive_align([by_tokens.get(tuple(s)) for s in seqs], mask)
    assert torch.equal(table.lookup(ids, mask), want)


def test_a_row_the_engine_did_not_generate_keeps_its_own_routing():
    table = RouteTable([[5, 6, 7]], [torch.ones(2, L, K)], L, K)
    ids = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 8], [5, 6, 7, 9]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    routes = table.lookup(ids, mask)
    assert routes.shape == (3, 4, L, K) and routes.dtype == torch.int16
    assert (routes[0, 1:3] == 1).all() and (routes[0, [0, 3]] == -1).all()  # padding and the last token: own
    assert (routes[1:] == -1).all()  # another last token; a longer sequence with the same prefix
    assert torch.equal(table(ids, mask), routes)  # the table is the routes function RoutingReplay calls
    assert (table.lookup(ids[2:, :3]) == 1).all(-1).all(-1)[0, :2].all()  # no mask: every token is real
    assert (RouteTable([], [], L, K).lookup(ids, mask) == -1).all()
    with pytest.raises(ValueError, match=r"routes of row 0 have shape \(2, 3\)"):
        align_routes([torch.ones(2, 3)], mask[:1], L, K)
