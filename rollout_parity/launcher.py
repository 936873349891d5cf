"""``rollout-parity launch``: run an unmodified TRL GRPO script with the shared flags.

    rollout-parity launch [--preset NAME] [shared flags] script.py [script args...]
    rollout-parity launch [--preset NAME] [shared flags] -m package.module [module args...]
    accelerate launch [accelerate args] -m rollout_parity.launcher [...same...]

In the spirit of ``accelerate launch`` / ``torchrun``: everything up to the script is ours,
everything after it is the script's. Before the script runs, the names a GRPO script imports
from TRL (``trl.GRPOConfig`` / ``trl.GRPOTrainer``, and the same in ``trl.trainer``) are bound
to the adapter's ``ParityGRPOConfig`` / ``ParityGRPOTrainer`` (subclasses, so ``isinstance``
and the script's own subclasses keep working), with the launcher's flags as defaults. So:

* a script parsing ``GRPOConfig`` with ``TrlParser`` (TRL's own ``trl/scripts/grpo.py``) accepts
  the shared flags in its own arguments too, which override the launcher's;
* a script building ``GRPOConfig(...)`` in code gets the launcher's flags as the defaults;
* a trainer built from a plain ``GRPOConfig`` (imported from ``trl.trainer.grpo_config``) still
  gets the launcher's flags through ``ParityGRPOTrainer.rollout_correction_default``.

The names are restored when the script returns. Scripts that import ``GRPOTrainer`` from
``trl.trainer.grpo_trainer`` itself are not redirected: the launcher says so at exit if no
trainer was built through it (use the import swap or ``apply`` there).

A script that imports ``nemo_rl`` (NeMo RL's ``examples/run_grpo*.py``) runs with the NeMo RL
hook on instead (``rollout_parity.adapters.nemo_rl.turn_on``): the flags come from its recipe's
``loss_fn.rollout_correction``, so none are taken here. verl takes the shared flags as Hydra overrides
(``+rollout_parity.<flag>=...``): the launcher's flags with a verl target are refused, naming the overrides.

``--dry-run`` shows what the adapter would do, and runs nothing (``rollout_parity/dry_run.py``)::

    rollout-parity launch --dry-run -m verl.trainer.main_ppo <hydra overrides...>
    rollout-parity launch --dry-run [shared flags] -m trl.scripts.grpo <TRL args...>   (or script.py [args...])

verl: verl's config composed as ``main_ppo`` composes it, put through the adapter's driver hook; printed:
the shared flags it read, each config key it changed (``before -> after``), the vLLM engine kwargs of the
rollout; a refusal is exit 2. Ray is imported with verl but never started. TRL: the script runs until its
``GRPOConfig`` is built (TRL's ``grpo.py``: its ``TrlParser`` parse returns, before ``load_dataset``), or its
trainer is being built; printed: the flags the trainer would use, the ``GRPOConfig`` fields that matter to
parity, the engine kwargs of the colocated vLLM (or the ``trl vllm-serve`` line). No model, dataset or engine
loads; a script that never builds a config exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
import typing
from typing import Any, Callable, Optional, Sequence

from rollout_parity._argv import add_switch, normalise_switches, spellings
from rollout_parity.core.config import LIST_FLAGS, CorrectionConfig, FlagError, flag_from_text

__all__ = ["main", "build_parser", "parse_args", "install", "correction_from_args"]

PROG = "rollout-parity launch"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Run a TRL GRPO script unmodified with rollout-parity's shared flags: the script's "
                    "trl.GRPOConfig / trl.GRPOTrainer become ParityGRPOConfig / ParityGRPOTrainer. A NeMo RL "
                    "script (one importing nemo_rl) runs with the NeMo RL hook on and takes the flags from its "
                    "recipe's loss_fn.rollout_correction instead. Options are snake_case (the kebab-case "
                    "spelling is an alias), switches take an optional true/false, and nothing is abbreviated. "
                    "--dry-run shows what the adapter would do without running anything: for "
                    "-m verl.trainer.main_ppo <hydra overrides> (flags as +rollout_parity.<flag>=... overrides) "
                    "the shared flags read, verl config keys changed and vLLM engine kwargs (Ray never "
                    "started); for a TRL script, the flags, the GRPOConfig fields that matter and the vLLM "
                    "engine kwargs, stopping once the script's config is built (before any model or dataset).",
        epilog="Example: rollout-parity launch --rollout_importance_sampling_mode token_truncate "
               "trl/scripts/grpo.py --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K "
               "--use_vllm",
    )
    add_switch(parser, "dry_run", default=False,
               help="print what rollout-parity would do to this command line (flags, config changes, vLLM engine "
                    "kwargs) and exit without training: verl's main_ppo config is composed, a TRL script stops "
                    "once its config is built; exit 2 on a refusal")
    parser.add_argument("--preset", default=None,
                        help=f"start from a correction preset ({', '.join(CorrectionConfig.available_presets())}); "
                             "the flags given override it")
    for field in dataclasses.fields(CorrectionConfig):
        help_text = field.metadata.get("help", "")
        if isinstance(field.default, bool):  # a switch: present means true; true/false may follow
            add_switch(parser, field.name, default=None, help=help_text)
        else:  # one value each, so the script's path is never taken for a flag value; lists are comma-separated
            metavar = "A,B" if field.name in LIST_FLAGS else "VALUE"
            parser.add_argument(*spellings(field.name), default=None, metavar=metavar, help=help_text)
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="MODULE ...",
                        help="run a module as a script, with the arguments that follow (like python -m)")
    parser.add_argument("target", nargs=argparse.REMAINDER, help="script.py [script args...] (or the module's args)")
    return parser


def correction_from_args(args: argparse.Namespace) -> CorrectionConfig:
    """The ``CorrectionConfig`` of the launcher's flags (a preset, overridden by the flags given)."""
    given = {f.name: flag_from_text(f.name, getattr(args, f.name)) for f in dataclasses.fields(CorrectionConfig)
             if getattr(args, f.name) is not None}
    return CorrectionConfig.preset(args.preset, **given) if args.preset else CorrectionConfig(**given)


def install(cfg: CorrectionConfig) -> tuple[Callable[[], None], list]:
    """Bind ``trl.GRPOConfig`` / ``trl.GRPOTrainer`` (and in ``trl.trainer``) to the adapter's classes.

    Returns ``(uninstall, built)``: ``uninstall()`` restores the previous names; ``built`` lists
    the trainers built through the launcher's class.
    """
    import trl
    import trl.trainer

    from rollout_parity.adapters._patching import Patches
    from rollout_parity.adapters.trl import ParityGRPOConfig, ParityGRPOTrainer

    hints = typing.get_type_hints(ParityGRPOConfig)
    fields = []
    for name, value in cfg.to_dict().items():  # the launcher's flags become the shared fields' defaults
        metadata = ParityGRPOConfig.__dataclass_fields__[name].metadata
        if name in LIST_FLAGS and value is not None:  # list fields take list defaults (TRL's parser needs them)
            items = value if isinstance(value, list) else [value]
            default = dataclasses.field(default_factory=lambda v=items: list(v), metadata=metadata)
        else:
            default = dataclasses.field(default=value, metadata=metadata)
        fields.append((name, hints[name], default))
    # Pickled (Trainer saves training_args.bin) as a plain ParityGRPOConfig holding the same values.
    reduce = {"__reduce_ex__": lambda self, protocol: (_parity_config, (self.__dict__,))}
    config_class = dataclasses.make_dataclass("GRPOConfig", fields, bases=(ParityGRPOConfig,), namespace=reduce)
    config_class.__module__ = __name__
    built: list = []

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        ParityGRPOTrainer.__init__(self, *args, **kwargs)
        built.append(self)

    trainer_class = type("GRPOTrainer", (ParityGRPOTrainer,), {
        "rollout_correction_default": cfg, "__init__": record, "__module__": __name__,
        "__doc__": f"TRL's GRPOTrainer with rollout-parity (rollout-parity launch: {cfg.to_dict()})."})
    # A name TRL's lazy module had not bound yet is unbound again on revert (imported anew on next access).
    patches = Patches()
    for module in (trl, trl.trainer):
        patches.replace(module, "GRPOConfig", config_class)
        patches.replace(module, "GRPOTrainer", trainer_class)
    # A script that imports the adapter's classes itself (the import swap, examples/trl_grpo.py) gets them too.
    adapter = sys.modules["rollout_parity.adapters.trl"]
    patches.replace(adapter, "ParityGRPOConfig", config_class)
    patches.replace(adapter, "ParityGRPOTrainer", trainer_class)
    return patches.revert, built


def _parity_config(state: dict) -> Any:
    """Unpickle a launched config as the importable ``ParityGRPOConfig`` (no ``__post_init__`` rerun)."""
    from rollout_parity.adapters.trl.config import ParityGRPOConfig  # the class itself, not a launch's binding

    config = ParityGRPOConfig.__new__(ParityGRPOConfig)
    config.__dict__.update(state)
    return config


def _run(module: Optional[str], target: Sequence[str]) -> int:
    """Run the script (or module) as ``__main__`` with its own ``sys.argv``; its exit code."""
    argv, path = sys.argv[:], sys.path[:]
    try:
        if module is not None:
            sys.argv = [module, *target]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            script = target[0]
            sys.argv = list(target)
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    except FlagError as exc:  # a shared flag the script's config parser (TRL) or recipe (NeMo RL) refused
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        sys.argv, sys.path[:] = argv, path
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The launcher's options, then the script (or ``-m module``) and its arguments, untouched.

    A switch right before the script (``--fp32_lm_head script.py``) is true, never given the path as
    its value; an unknown or abbreviated option exits 2 with one line naming the closest one.
    """
    parser = build_parser()
    raw = list(argv)
    argv, refusal = normalise_switches(raw, parser, PROG, stop_at=("-m",))
    if refusal is not None:
        parser.exit(2, refusal + "\n")
    args = parser.parse_args(argv)
    if not (args.module or args.target):
        parser.error("give a script (script.py [args...]) or -m module [args...]")
    args.raw_argv = raw
    return args


def _no_script(raw: Sequence[str], script: str, parser: argparse.ArgumentParser) -> str:
    """The one-line refusal of a script path that is no file, before anything loads: a word after a switch that
    is neither true/false nor a file was meant as the switch's value (``--fp32_lm_head ture``)."""
    at = len(raw) - 1 - raw[::-1].index(script) if script in raw else -1
    before = raw[at - 1] if at > 0 else ""
    action = parser._option_string_actions.get(before)  # noqa: SLF001 - argparse's own table
    if action is not None and action.nargs == "?" and action.const is True:
        return (f"{PROG}: {before} takes true or false, got {script!r} (and {script!r} is no script either: "
                f"write {before} true|false, then the script)")
    return f"{PROG}: no script {script!r} (no such file; for a module, -m package.module)"


def main(argv: Sequence[str]) -> int:
    """``rollout-parity launch``; returns the script's exit code (2 for a bad launcher flag)."""
    args = parse_args(argv)
    try:
        cfg = correction_from_args(args)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if not args.module and not os.path.isfile(args.target[0]):  # named before anything loads
        print(_no_script(args.raw_argv, args.target[0], build_parser()), file=sys.stderr)
        return 2
    from rollout_parity.dry_run import dry_run, targets_verl, verl_flag_refusal

    if targets_verl(script=None if args.module else args.target[0], module=args.module[0] if args.module else None):
        refusal = verl_flag_refusal(args, f"-m {args.module[0]}" if args.module else args.target[0])
        if refusal is not None:
            print(refusal, file=sys.stderr)
            return 2
    if args.dry_run:
        return dry_run(args, cfg)
    from rollout_parity.adapters.nemo_rl.turn_on import launch as launch_nemo_rl, targets_nemo_rl

    if targets_nemo_rl(script=None if args.module else args.target[0], module=args.module[0] if args.module else None):
        given = [f"--{f.name}" for f in dataclasses.fields(CorrectionConfig) if getattr(args, f.name) is not None]
        run = (lambda: _run(args.module[0], args.module[1:])) if args.module else (lambda: _run(None, args.target))
        return launch_nemo_rl(run, given + (["--preset"] if args.preset else []))
    uninstall, built = install(cfg)
    script_args = args.module[1:] if args.module else args.target[1:]
    try:
        code = _run(args.module[0], script_args) if args.module else _run(None, args.target)
    finally:
        uninstall()
    if code == 0 and not built and not {"-h", "--help"} & set(script_args):
        # a line that parses is not a line that works: a run in which no flag acted is not a success
        print(f"{PROG}: the script built no GRPOTrainer through trl.GRPOTrainer or ParityGRPOTrainer, so no flag "
              "acted (a script importing trl.trainer.grpo_trainer.GRPOTrainer directly needs the import swap or "
              "apply()); exit 1", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
