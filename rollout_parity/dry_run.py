"""``rollout-parity launch --dry-run``: what the adapters would do to a verl or TRL command line, without the run.

    rollout-parity launch --dry-run -m verl.trainer.main_ppo <hydra overrides...>
    rollout-parity launch --dry-run [shared flags] -m trl.scripts.grpo <TRL args...>
    rollout-parity launch --dry-run [shared flags] script.py [script args...]

verl: the config is composed as ``main_ppo``'s ``@hydra.main(config_path="config", config_name="ppo_trainer")``
composes it (verl's own config directory, the overrides unchanged, Hydra's ``--config-path``/``--config-name``
honoured, ``HydraConfig`` set as in a Hydra job), then goes through the verl adapter's driver hook
(``adapters/verl/patches.py``: ``configure_verl``, the call verl's ``auto_set_device``/``validate_config`` make).
Printed: the shared flags the hook read, each key of verl's config it changed (``before -> after``), and the vLLM
engine kwargs verl's rollout server passes over its own arguments (``vLLMHttpServer.launch_server``:
``engine_kwargs.vllm`` without its null values). A refusal is the hook's one line, exit 2. ``import verl`` imports
Ray (``verl/protocol.py``), so Ray is imported, but it is never started: no ``ray.init``, no model, no data.

TRL: the launcher binds its classes as for a run (``launcher.install``) and runs the script until the first of
(a) a ``TrlParser.parse_args_and_config`` / ``HfArgumentParser.parse_*`` call returning a ``GRPOConfig``
(TRL's ``trl/scripts/grpo.py`` parses in ``__main__`` before ``main()`` calls ``load_dataset``; a config built
inside that parse is reported when the parse returns, with the parse's model name), (b) the launcher's
``GRPOConfig`` built outside a parse, (c) a ``GRPOTrainer`` being constructed (before its ``__init__`` runs).
Printed: the shared flags the trainer would use, the ``GRPOConfig`` fields that matter to parity, and the vLLM
engine kwargs the adapter gives TRL's colocated engine (or the ``trl vllm-serve`` line for server mode); the
trainer's refusals (``adapters/trl/refusals.py``) run first, exit 2. A script that ends without building a config
exits 1 saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from rollout_parity.core.config import LIST_FLAGS, CorrectionConfig

__all__ = ["VERL_MAIN", "targets_verl", "verl_flag_refusal", "dry_run"]

PROG = "rollout-parity launch"
VERL_MAIN = "verl.trainer.main_ppo"
_MAIN_CONFIG = ("config", "ppo_trainer")  # main_ppo's @hydra.main(config_path=..., config_name=...)
_IMPORTS_VERL = re.compile(r"^\s*(from|import)\s+verl\b", re.MULTILINE)
#: Hydra's own options that --dry-run does not act out (it composes one config, as a run does).
_HYDRA_REFUSED = {"help": "--help", "hydra_help": "--hydra-help", "cfg": "--cfg", "resolve": "--resolve",
                  "package": "--package", "multirun": "--multirun", "shell_completion": "--shell-completion",
                  "config_dir": "--config-dir", "experimental_rerun": "--experimental-rerun", "info": "--info"}
#: The GRPOConfig fields that decide what parity means in a TRL run (those this TRL has are printed).
TRL_PARITY_FIELDS = (
    "use_vllm", "vllm_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap",
    "off_policy_mask_threshold", "loss_type", "importance_sampling_level", "max_completion_length",
    "num_generations", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "generation_kwargs",
    "bf16", "fp16", "cast_lm_head_to_fp32", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
)


def _text(value: Any) -> str:
    """One value as JSON text (null/true/false, as Hydra and YAML read them)."""
    return json.dumps(value, sort_keys=True, default=str)


def _section(title: str, items: Iterable[tuple[str, Any]]) -> list[str]:
    return [title] + [f"  {key}: {_text(value)}" for key, value in items]


def _flags_section(cfg: CorrectionConfig, where: str) -> list[str]:
    return _section(f"shared flags (CorrectionConfig), as {where}:", cfg.to_dict().items())


def _source_imports(pattern: re.Pattern, script: Optional[str], module: Optional[str]) -> bool:
    path = script
    if module is not None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return False
        path = spec.origin if spec is not None else None
    try:
        return bool(path) and Path(path).is_file() and bool(pattern.search(Path(path).read_text(errors="replace")))
    except OSError:
        return False


def targets_verl(script: Optional[str], module: Optional[str]) -> bool:
    """``-m verl.<...>`` (read by name: finding a verl module imports verl), or a script whose source imports verl."""
    if module is not None:
        return module.split(".")[0] == "verl"
    return _source_imports(_IMPORTS_VERL, script, None)


def verl_flag_refusal(args: Any, target: str) -> Optional[str]:
    """The one line refusing launcher flags for a verl ``target``, with the Hydra overrides to write instead."""
    fixes = []
    for field in dataclasses.fields(CorrectionConfig):
        value = getattr(args, field.name)
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        if field.name in LIST_FLAGS and "," in text and not text.startswith("["):
            text = f"[{text}]"
        fixes.append((f"--{field.name}", f"+rollout_parity.{field.name}={text}"))
    if args.preset:
        fixes.insert(0, ("--preset", f"+rollout_parity.preset={args.preset}"))
    if not fixes:
        return None
    return (f"{PROG}: {', '.join(f for f, _ in fixes)}: verl takes the shared flags as Hydra overrides, not as "
            f"launcher flags; write {' '.join(o for _, o in fixes)} after {target}")


def dry_run(args: Any, cfg: CorrectionConfig) -> int:
    """``rollout-parity launch --dry-run``: prints the report, returns the exit code (0 shown, 1 nothing to show,
    2 refused)."""
    module = args.module[0] if args.module else None
    script = None if module else args.target[0]
    script_args = list(args.module[1:] if args.module else args.target[1:])
    from rollout_parity.adapters.nemo_rl.turn_on import targets_nemo_rl

    if targets_nemo_rl(script=script, module=module):
        print(f"{PROG}: --dry-run shows TRL scripts and -m {VERL_MAIN}; a NeMo RL script takes its flags from its "
              "recipe (loss_fn.rollout_correction): run it without --dry-run", file=sys.stderr)
        return 2
    if module == VERL_MAIN:
        return _verl(script_args)
    if targets_verl(script, module) or _source_imports(_IMPORTS_VERL, None, module):
        print(f"{PROG}: --dry-run composes verl's config for -m {VERL_MAIN} only; {module or script} would run its "
              "own main (and start Ray)", file=sys.stderr)
        return 2
    return _trl(module, script, script_args, cfg)


# --------------------------------------------------------------------------------------------------- verl


def _hydra_options(argv: Sequence[str]) -> tuple[Optional[argparse.Namespace], Optional[str]]:
    """main_ppo's command line read by Hydra's own parser (the one ``@hydra.main`` uses); a refusal line or None."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = f"{PROG} --dry-run -m {VERL_MAIN}"
    options = parser.parse_args(list(argv))
    used = [flag for dest, flag in _HYDRA_REFUSED.items() if getattr(options, dest, None) not in (None, False)]
    if used:
        return None, (f"{PROG}: --dry-run composes the one config a run of {VERL_MAIN} gets; Hydra's "
                      f"{', '.join(used)} is not acted out (drop it; --config-path and --config-name are honoured)")
    return options, None


@contextlib.contextmanager
def _hydra_job_config(config: Any) -> Any:
    """``HydraConfig`` set as in a Hydra job (``hydra.core.utils.run_job``); the previous one back afterwards."""
    from hydra.core.hydra_config import HydraConfig

    instance = HydraConfig.instance()
    saved = instance.cfg
    instance.set_config(config)
    try:
        yield
    finally:
        instance.cfg = saved


def _compose_main_ppo(options: Any) -> tuple[Any, Any, str]:
    """verl's config as ``main_ppo``'s ``@hydra.main`` composes it: ``(config with its hydra node, the job's
    config, where)``."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra._internal.utils import compute_search_path_dir
    from omegaconf import open_dict, read_write

    main_file = importlib.util.find_spec(VERL_MAIN).origin
    config_path = options.config_path if options.config_path is not None else _MAIN_CONFIG[0]
    config_name = options.config_name if options.config_name is not None else _MAIN_CONFIG[1]
    search_dir = compute_search_path_dir(main_file, None, config_path)  # what @hydra.main searches
    if search_dir.startswith("pkg://"):
        init = initialize_config_module(config_module=search_dir[len("pkg://"):].replace("/", "."), version_base=None,
                                        job_name="main_ppo")
    else:
        init = initialize_config_dir(config_dir=search_dir, version_base=None, job_name="main_ppo")
    with init:
        full = compose(config_name=config_name, overrides=list(options.overrides), return_hydra_config=True)
    job = copy.deepcopy(full)
    with read_write(job), open_dict(job):
        del job["hydra"]
    return full, job, f"{config_name} from {search_dir}"


def _verl_engine_kwargs(config: Any, engine: str) -> dict:
    """What verl's rollout server (``vLLMHttpServer`` / ``SGLangHttpServer``) ``launch_server`` takes from the config
    over its own arguments: ``actor_rollout_ref.rollout.engine_kwargs.<engine>`` without null values."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(config, f"actor_rollout_ref.rollout.engine_kwargs.{engine}", default=None)
    if not isinstance(node, DictConfig):
        return {}
    try:
        kwargs = OmegaConf.to_container(node, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only the run resolves: shown as written
        kwargs = OmegaConf.to_container(node, resolve=False)
    return {k: v for k, v in sorted(kwargs.items()) if v is not None}


def _verl(hydra_argv: Sequence[str]) -> int:
    options, refusal = _hydra_options(hydra_argv)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rollout_parity.adapters import verl as adapter  # imports verl (and verl imports Ray; nothing starts it)
    from rollout_parity.adapters.verl import config as verl_config, flags
    from rollout_parity.adapters.verl.compat import verl_version
    from rollout_parity.adapters.verl.patches import ConfigRefusal, _configure

    try:
        full, config, where = _compose_main_ppo(options)
    except (HydraException, OmegaConfBaseException) as exc:
        said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"{PROG} --dry-run: Hydra could not compose {VERL_MAIN}'s config: {said}", file=sys.stderr)
        return 2
    before = OmegaConf.to_container(config, resolve=False)
    saved_env = {key: os.environ.get(key) for key in (flags.ENV_CONFIG, flags.ENV_SAMPLER)}
    try:
        with _hydra_job_config(full), contextlib.redirect_stdout(sys.stderr):
            _configure(config)  # the driver hook main_ppo runs (auto_set_device / validate_config)
        cfg = adapter.correction_config_from_verl(config)
        sampler = adapter.active_sampler() if cfg is not None else None
    except ConfigRefusal as exc:
        print(exc, file=sys.stderr)
        return 2
    finally:  # the hook made the flags this process's (for Ray to carry): a dry run leaves none behind
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if cfg is None:
        print(f"{PROG} --dry-run: no +rollout_parity.* override, so the verl adapter leaves {VERL_MAIN}'s config "
              "as it is and no flag acts (add e.g. +rollout_parity.rollout_importance_sampling_mode=token_truncate)",
              file=sys.stderr)
        return 1
    flags_json = flags.carried_env(cfg)[flags.ENV_CONFIG]
    lines = [f"{PROG} --dry-run: {VERL_MAIN}, verl {verl_version()}, config {where}, "
             f"{len(options.overrides)} override(s)"]
    lines += _flags_section(cfg, "the verl adapter read them (+rollout_parity.*)")
    aware = "off" if sampler is None else f"on (rollout top_k={_text(sampler.top_k)}, top_p={_text(sampler.top_p)})"
    lines.append(f"  sampler-aware pi_old: {aware}")
    lines.append("verl config changed by the adapter (key: before -> after):")
    block_written = False
    changes = []
    for key, old, new in verl_config._changed_keys(before, OmegaConf.to_container(config, resolve=False)):
        # a node the adapter created whole (verl's config had none): one line per key in it
        changes += verl_config._changed_keys({}, new, f"{key}.") if old is None and isinstance(new, dict) and new \
            else [(key, old, new)]
    for key, old, new in changes:
        if key == flags.CONFIG_KEY or key.startswith(flags.CONFIG_KEY + "."):
            block_written = True
            continue
        shown = "<the shared flags above, as JSON>" if new == flags_json else _text(new)
        lines.append(f"  {key}: {_text(old)} -> {shown}")
    if block_written:
        lines.append(f"  {flags.CONFIG_KEY}: written in full (the shared flags above)")
    from rollout_parity import registry
    from rollout_parity.adapters.verl.config import select

    engine = registry.unit(select(config, "actor_rollout_ref.rollout.name", "vllm"))  # refused by the hook if not ours
    lines += _section(f"{engine.name} engine kwargs (actor_rollout_ref.rollout.engine_kwargs.{engine.key}: verl's "
                      "server passes them over its own):", _verl_engine_kwargs(config, engine.key).items())
    lines.append("dry run: Ray not started, no model or data read")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------------------------------- TRL


class _Built(BaseException):
    """Raised in the script the moment its config is built: ends the run there (a ``BaseException``, so the
    script's own ``except Exception`` does not swallow it)."""

    def __init__(self, where: str, config: Any, model: Any = None, trainer: Any = None,
                 rollout_correction: Any = None) -> None:
        super().__init__(where)
        self.where, self.config, self.model = where, config, model
        self.trainer, self.rollout_correction = trainer, rollout_correction


def _parser_classes() -> list[type]:
    """Every class whose ``parse_*`` methods build TRL configs from a command line or file."""
    import transformers

    from trl.scripts.utils import TrlParser

    classes = [TrlParser, transformers.HfArgumentParser]
    with contextlib.suppress(ImportError):
        from trl.scripts import _hf_argparser

        classes.append(_hf_argparser.HfArgumentParser)
    return list(dict.fromkeys(classes))


def _stop_points(patches: Any, config_class: type, trainer_class: type) -> None:
    """Wrap the three points of (a), (b), (c) with ``patches`` (the shared patch layer)."""
    from trl.trainer.grpo_config import GRPOConfig as TrlGRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer as TrlGRPOTrainer

    depth = [0]  # parse calls in progress (TrlParser.parse_args_and_config calls parse_args_into_dataclasses)

    def parsed(name: str) -> Any:
        def behaviour(original: Any, parser: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                out = original(parser, *args, **kwargs)
            finally:
                depth[0] -= 1
            items = out if isinstance(out, tuple) else (out,)
            config = next((x for x in items if isinstance(x, TrlGRPOConfig)), None)
            if depth[0] == 0 and config is not None:
                model = next((getattr(x, "model_name_or_path") for x in items
                              if x is not config and getattr(x, "model_name_or_path", None)), None)
                raise _Built(f"{type(parser).__name__}.{name} returned", config, model=model)
            return out
        return behaviour

    for cls in _parser_classes():
        for name in ("parse_args_and_config", "parse_args_into_dataclasses", "parse_dict", "parse_json_file",
                     "parse_yaml_file"):
            if name in vars(cls):
                patches.wrap(cls, name, parsed(name), dotted=f"{cls.__module__}.{cls.__name__}.{name}")

    def config_built(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)
        if depth[0] == 0:
            raise _Built("trl.GRPOConfig(...) was built", self)

    patches.wrap(config_class, "__init__", config_built, dotted="trl.GRPOConfig.__init__")

    from rollout_parity.adapters.trl.trainer import ParityGRPOTrainer

    signature = inspect.signature(ParityGRPOTrainer.__init__)

    def trainer_built(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs).arguments
        raise _Built(f"{type(self).__name__}(...) was being built", bound.get("args"), model=bound.get("model"),
                     trainer=self, rollout_correction=bound.get("rollout_correction"))

    patches.wrap(trainer_class, "__init__", trainer_built, dotted="trl.GRPOTrainer.__init__")

    def trl_trainer_built(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(self, *args, **kwargs).arguments
        raise _Built("trl.trainer.grpo_trainer.GRPOTrainer(...) was being built", bound.get("args"),
                     model=bound.get("model"), trainer=self)

    patches.wrap(TrlGRPOTrainer, "__init__", trl_trainer_built, dotted="trl.trainer.grpo_trainer.GRPOTrainer.__init__")


def _model_name(model: Any) -> Optional[str]:
    if model is None or isinstance(model, str):
        return model
    return getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)


def _trl(module: Optional[str], script: Optional[str], script_args: list[str], launcher_cfg: CorrectionConfig) -> int:
    import trl

    from rollout_parity.adapters._patching import Patches
    from rollout_parity.launcher import _run, install

    uninstall, _ = install(launcher_cfg)
    patches = Patches()
    try:
        _stop_points(patches, trl.GRPOConfig, trl.GRPOTrainer)
        code = _run(module, script_args) if module else _run(None, [script, *script_args])
    except _Built as built:
        stop = built
    else:
        if code == 0 and not {"-h", "--help"} & set(script_args):
            print(f"{PROG} --dry-run: {module or script} ended without building a GRPOConfig or a GRPOTrainer (no "
                  "TrlParser/HfArgumentParser parse returned one, no trl.GRPOConfig or GRPOTrainer was built): "
                  "nothing to show; exit 1", file=sys.stderr)
            return 1
        return code
    finally:
        patches.revert()
        uninstall()
    return _trl_report(stop, module or script, launcher_cfg)


def _trl_report(stop: _Built, target: str, launcher_cfg: CorrectionConfig) -> int:
    from rollout_parity.adapters.trl.config import ParityGRPOConfig, as_correction_config
    from rollout_parity.adapters.trl.engine import colocated_engine_kwargs, engine_options, server_command
    from rollout_parity.adapters._refusals import needs_rollout_logprobs
    from rollout_parity.adapters.trl.refusals import TRL_RATIO_FIELDS, refuse
    from rollout_parity.adapters.trl.trainer import ParityGRPOTrainer, _model_config

    config, trainer = stop.config, stop.trainer
    if trainer is not None and not isinstance(trainer, ParityGRPOTrainer):
        print(f"{PROG} --dry-run: {target} builds TRL's GRPOTrainer from trl.trainer.grpo_trainer directly, so no flag "
              "would act (a script importing it needs the import swap or apply()); exit 1", file=sys.stderr)
        return 1
    if config is None:
        print(f"{PROG} --dry-run: {target} builds its GRPOTrainer without args=, so TRL makes a default GRPOConfig "
              "inside it; give args=GRPOConfig(...) to see (and set) what matters to parity; exit 1", file=sys.stderr)
        return 1
    # The flags as ParityGRPOTrainer.__init__ takes them: rollout_correction=, else a ParityGRPOConfig's own, else the
    # class default (the launcher's flags).
    default = stop.rollout_correction
    if default is None and not isinstance(config, ParityGRPOConfig):
        default = type(trainer).rollout_correction_default if trainer is not None else launcher_cfg
    cfg = as_correction_config(default, config)
    model = _model_name(stop.model)
    # A model's config is read only from a local directory (or a built model): a dry run downloads nothing.
    readable = stop.model is not None and not (isinstance(stop.model, str) and not os.path.isdir(stop.model))
    model_config = _model_config(stop.model, config) if readable else None
    colocate = bool(config.use_vllm) and getattr(config, "vllm_mode", None) == "colocate"
    try:
        settings = refuse(cfg, config, config, model_config=model_config,  # what ParityGRPOTrainer refuses first
                          off_policy_mask_threshold=config.off_policy_mask_threshold)
        if getattr(cfg, "precision", None) is not None:  # then its fp16/bf16 and load dtype, as the trainer sets them
            from rollout_parity.adapters.trl.precision import precision_onto_args

            precision_onto_args(cfg.precision, config, stop.model, model_config)
        engine_kwargs = colocated_engine_kwargs({}, **engine_options(cfg)) if colocate else None
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    lines = [f"{PROG} --dry-run: {target}, trl {trl_version()}; stopped when {stop.where}, before any model, "
             "dataset or vLLM engine loaded"]
    lines += _flags_section(cfg, "the trainer would use them")
    lines.append("GRPOConfig (the fields that matter to parity):")
    for name in TRL_PARITY_FIELDS:
        if not hasattr(config, name):
            continue
        value = getattr(config, name)
        note = ""  # what the trainer changes (ParityGRPOTrainer.__init__, patches.apply)
        if name == "cast_lm_head_to_fp32" and cfg.fp32_lm_head and not value:
            value, note = True, "  (fp32_lm_head turns it on)"
        elif name in TRL_RATIO_FIELDS and (cfg.changes_loss or cfg.old_logprob_source == "bypass"):
            note = "  (TRL's own ratio: the shared flags' weights replace it)"
        elif name == "vllm_importance_sampling_correction" and not value and needs_rollout_logprobs(cfg):
            value, note = True, "  (the adapter turns it on: the channel of its weights)"
        elif name == "off_policy_mask_threshold" and cfg.off_policy_sequence_mask_delta is not None:
            value, note = cfg.off_policy_sequence_mask_delta, "  (off_policy_sequence_mask_delta)"
        lines.append(f"  {name}: {_text(value)}{note}")
    if not config.use_vllm:
        lines.append("vLLM: not used (use_vllm=false)")
    elif colocate:
        lines += _section("vLLM engine kwargs (vllm_mode=colocate: the adapter's recipe, over the kwargs TRL passes to "
                          "vllm.LLM):", sorted(engine_kwargs.items()))
    else:
        policy = engine_options(cfg)["prefix_cache_policy"]
        lines.append(f"vLLM server (vllm_mode={config.vllm_mode}): serve the model with the parity recipe:")
        lines.append("  " + server_command(model or "MODEL", fp32_lm_head=cfg.fp32_lm_head, prefix_cache_policy=policy,
                                            precision=cfg.precision))
    if settings.truncates and model_config is None:
        lines.append(f"note: the sampler truncates and {model or 'the model'}'s config was not read here (not a local "
                     "directory): its head modifiers are checked when the trainer starts")
    print("\n".join(lines))
    return 0


def trl_version() -> str:
    from rollout_parity.core.versions import installed_version

    return installed_version(("trl",)) or "?"
