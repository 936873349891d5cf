"""Rerun chosen tests under several seeds, thread counts and orders; print each bound's spread and margin.

The suite writes every bound between two engines or runs as ``assert bound(name, value, op, limit)``
(``integration_tests/support/spread.py``). This runs pytest once per condition with that bound log on and
prints, per bound, the values it took (a bound past its limit is recorded, not raised, so the bounds after it
in the same test are measured too): the numbers written beside each bound come from here.

    wt-run python scripts/measure_spread.py integration_tests/test_sampling_replay.py --seeds 0 1 2 3 4 \
        --save integration_tests/data/spread/test_sampling_replay.json
    wt-run python scripts/measure_spread.py integration_tests/test_vllm_parity.py --seeds 0 1 2 --threads 1 2
    wt-run python scripts/measure_spread.py integration_tests/test_vllm_parity.py --reverse   # module-shared engine
    wt-run python scripts/measure_spread.py integration_tests/test_x.py --before integration_tests/test_y.py

Conditions (the product of them is run): ``--seeds`` (``ROLLOUT_PARITY_SEED``: the sampling seed of the
suite's engines and of the runs that take it), ``--threads`` (``OMP_NUM_THREADS``; the suite's conftest sets 1
unless the caller sets it), the order (``--reverse`` adds a run with the tests in reverse collection order:
tests sharing a module engine or trainer see its state after other tests), ``--before`` (tests run first
in the same process) and ``--runs`` (repeats of each condition). ``--json`` keeps every record.

Margin: ``limit / worst`` for an upper bound, ``worst / limit`` for a lower one (worst: the value closest to the
limit over every run; signs handled so that a margin above 1 means the bound held by that factor).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from integration_tests.support.spread import LOG_ENV, SEED_ENV  # noqa: E402


def margin(op: str, limit: float, values: list[float]) -> tuple[float, float]:
    """(worst value, margin): the value closest to the limit and how many times over the bound it held."""
    upper = op in ("<", "<=")
    worst = max(values) if upper else min(values)
    if limit == 0 or worst == 0:
        return worst, math.nan
    if (worst > 0) != (limit > 0):  # on the far side of zero: held by any factor (or failed outright)
        held = worst < limit if upper else worst > limit
        return worst, math.inf if held else 0.0
    ratio = limit / worst if upper else worst / limit
    return worst, ratio if limit > 0 else 1 / ratio


#: Lines of pytest's output printed for a condition that failed.
FAILED_TAIL = 60


def collect(targets: list[str], extra: list[str], env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *targets, *extra], capture_output=True, text=True, env=env, cwd=ROOT)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        raise SystemExit(f"no tests collected from {targets}:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return ids


def run_condition(targets: list[str], extra: list[str], env: dict, log: Path, label: str, verbose: bool) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *targets, *extra]
    proc = subprocess.run(cmd, capture_output=not verbose, text=True, env=env, cwd=ROOT)
    summary = (proc.stdout or "").strip().splitlines()[-1:] if not verbose else []
    print(f"[measure_spread] {label}: exit {proc.returncode} in {time.time() - t0:.0f} s "
          f"{summary[0] if summary else ''}", flush=True)
    if proc.returncode and not verbose:  # what failed: without it a failed condition cannot be told from a flake
        print("\n".join(f"    | {line}" for line in (proc.stdout or "").splitlines()[-FAILED_TAIL:]), flush=True)
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    for r in records:
        r["condition"] = label
    return {"label": label, "returncode": proc.returncode, "records": records, "seconds": time.time() - t0}


def group(runs: list[dict]) -> dict[tuple, list[dict]]:
    by_bound: dict[tuple, list[dict]] = defaultdict(list)
    for run in runs:
        for r in run["records"]:
            by_bound[(r["test"], r["name"], r["op"], r["limit"])].append(r)
    return by_bound


def summary(runs: list[dict], command: str) -> dict:
    """What ``--save`` keeps: the command, each condition's exit and time, and per bound its values and margin."""
    bounds = []
    for (test, name, op, limit), recs in sorted(group(runs).items()):
        values = [float(r["value"]) for r in recs]
        worst, m = margin(op, limit, values)
        bounds.append({"test": test, "name": name, "op": op, "limit": limit, "n": len(values),
                       "min": min(values), "max": max(values), "worst": worst,
                       "margin": m if math.isfinite(m) else str(m),
                       "values": {r["condition"]: float(r["value"]) for r in recs}})
    return {"command": command, "runs": [{"condition": r["label"], "exit": r["returncode"],
                                          "seconds": round(r["seconds"])} for r in runs], "bounds": bounds}


def report(runs: list[dict]) -> None:
    by_bound = group(runs)
    print(f"\n{len(runs)} run(s): " + "; ".join(f"{r['label']} (exit {r['returncode']})" for r in runs))
    for (test, name, op, limit), recs in sorted(by_bound.items()):
        values = [float(r["value"]) for r in recs]
        worst, m = margin(op, limit, values)
        finite = [v for v in values if math.isfinite(v)]  # a gap can be inf (no common token): no mean then
        mean = statistics.fmean(finite) if len(finite) == len(values) else math.nan
        sd = statistics.stdev(finite) if len(finite) == len(values) > 1 else math.nan
        failed = sum(not r["held"] for r in recs)
        print(f"\n{test}\n  {name}: {op} {limit:g}  n={len(values)}  min {min(values):.3g}  max {max(values):.3g}  "
              f"mean {mean:.3g} ± {sd:.2g}  worst {worst:.3g}  margin {m:.2f}x"
              + (f"  FAILED {failed}" if failed else ""))
        print("    " + ", ".join(f"{r['condition']}: {float(r['value']):.3g}" for r in recs))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="+", help="pytest files or node ids")
    p.add_argument("-k", dest="keyword", help="pytest -k expression")
    p.add_argument("-m", dest="markers", help="pytest -m expression (e.g. extended: the suite's default run leaves "
                   "those tests out)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="values of ROLLOUT_PARITY_SEED (default: 0)")
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="values of OMP_NUM_THREADS (default: 1)")
    p.add_argument("--reverse", action="store_true", help="also run the tests in reverse collection order")
    p.add_argument("--before", nargs="+", default=[], help="tests to run first, in the same process")
    p.add_argument("--runs", type=int, default=1, help="repeats of each condition (default: 1)")
    p.add_argument("--json", type=Path, help="write every record here")
    p.add_argument("--save", type=Path, help="write the command and each bound's values and margin here (the file "
                   "the comments beside the bounds cite, e.g. integration_tests/data/spread/<module>.json)")
    p.add_argument("--verbose", action="store_true", help="show pytest's output")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    extra = (["-k", args.keyword] if args.keyword else []) + (["-m", args.markers] if args.markers else [])
    base = dict(os.environ)
    orders = ["as collected"] + (["reversed"] if args.reverse else [])
    command = "wt-run python scripts/measure_spread.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs = []
    with tempfile.TemporaryDirectory(prefix="spread-") as tmp:
        for i, (threads, seed, order, rep) in enumerate(itertools.product(args.threads, args.seeds, orders,
                                                                          range(args.runs))):
            log = Path(tmp) / f"run{i}.jsonl"
            env = dict(base, **{LOG_ENV: str(log), SEED_ENV: str(seed), "OMP_NUM_THREADS": str(threads)})
            targets = list(args.targets)
            if order == "reversed":
                targets = collect(targets, extra, env)[::-1]
            label = (f"seed {seed}, {threads} thread(s)" + (", reversed" if order == "reversed" else "")
                     + (f", after {' '.join(args.before)}" if args.before else "")
                     + (f", run {rep + 1}" if args.runs > 1 else ""))
            runs.append(run_condition([*args.before, *targets], extra, env, log, label, args.verbose))
            if args.save:  # after every condition: a long measurement stopped midway keeps what it measured
                args.save.parent.mkdir(parents=True, exist_ok=True)
                args.save.write_text(json.dumps(summary(runs, command), indent=1) + "\n")
    report(runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    held = all(r["held"] for run in runs for r in run["records"])  # bounds record a miss and let the test go on
    return 0 if held and all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
