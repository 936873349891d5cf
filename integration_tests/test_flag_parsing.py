"""The shared flags as each real parser hands them over: K1 ranges that cannot be misread, typos refused.

K1 ranges (issue 32, item 3). YAML (PyYAML, OmegaConf) and Hydra read an unquoted ``0.9_1`` as the
number 0.91 ('_' groups digits), which a K1 option once took as the range [0.91, 1.099]; on a
command line the same text is the range [0.9, 1.0]. Now a single K1 value must be > 1 (hi, the
range [1/hi, hi]) and a range must hold 1 strictly inside: every such misparse is refused with the
quoting fix, and the forms that cannot be mangled (a quoted ``'lo_hi'``, a pair ``[lo, hi]``, one
hi > 1) mean the same in every parser. Each parser here is the real one: PyYAML and OmegaConf,
Hydra composing verl's own config, TRL's ``TrlParser`` (command line and YAML file), the launcher.
NeMo RL's recipes: integration_tests/test_nemo_rl_turn_on.py.

Typos (item 8): a misspelt or abbreviated flag is refused in at most 3 lines naming the closest
flag, with no traceback. verl's real ``main_ppo``: integration_tests/test_verl_adapter.py.
"""

from __future__ import annotations

import io
import re
import textwrap
from contextlib import redirect_stderr

import pytest
import yaml

from rollout_parity import CorrectionConfig
from rollout_parity.core.config import FlagError, refuse_unknown
from rollout_parity.testing.stack import need

K1 = ["seq_mean_k1"]
QUOTING = "quote it ('0.9_1.1') or write the pair [0.9, 1.1]"


# ----------------------------------------------------------------------------- K1 ranges


def _yaml_block(threshold: str) -> str:
    return textwrap.dedent(f"""\
        rollout_rejection: [seq_mean_k1]
        rollout_rejection_threshold: {threshold}
        """)


def _omegaconf_load(text: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.create(text), resolve=True)


LOADERS = {"pyyaml": yaml.safe_load, "omegaconf": _omegaconf_load}  # TRL's YAML files; presets, NeMo RL, verl


@pytest.mark.parametrize("loader", list(LOADERS))
def test_an_unquoted_range_that_yaml_reads_as_a_number_is_refused_with_the_quoting_fix(loader):
    data = LOADERS[loader](_yaml_block("0.9_1"))
    assert data["rollout_rejection_threshold"] == pytest.approx(0.91)  # the hazard itself, as YAML reads it
    with pytest.raises(FlagError, match="got 0.91") as info:
        CorrectionConfig.from_dict(data)
    assert QUOTING in str(info.value) and len(str(info.value).splitlines()) == 1


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("written,expected", [
    ("'0.9_1.1'", (0.9, 1.1)),  # quoted: a string, as verl writes it
    ("0.9_1.1", (0.9, 1.1)),  # two dots: no number, YAML keeps the text
    ("[0.9, 1.1]", (0.9, 1.1)),  # the pair: nothing to mangle
    ("1.25", (0.8, 1.25)),  # one hi > 1: [1/hi, hi]
    ("2", (0.5, 2.0)),
])
def test_the_forms_yaml_cannot_mangle_mean_one_range(loader, written, expected):
    cfg = CorrectionConfig.from_dict(LOADERS[loader](_yaml_block(written)))
    rule = cfg.rejection_rules[0]
    assert (rule.lower, rule.upper) == pytest.approx(expected)


@pytest.mark.parametrize("spec", [0.91, 0.5, 1.0, "1", [1.0, 2.0], [0.5, 0.9], "0.9_1", "1.0_1.5", "0.9_1.0"])
def test_a_k1_range_without_1_strictly_inside_is_refused(spec):
    """A sequence with no mismatch has K1 = 0, a ratio of 1: a range without it rejects healthy data."""
    with pytest.raises(FlagError, match="rollout_rejection_threshold: seq_mean_k1"):
        CorrectionConfig(rollout_rejection=K1, rollout_rejection_threshold=spec)


@pytest.mark.verl
@pytest.mark.parametrize("override,expected", [
    ("0.9_1", None),  # Hydra's grammar reads it as the float 0.91: refused
    ("'0.9_1.1'", (0.9, 1.1)),
    ("0.9_1.1", (0.9, 1.1)),
    ("[0.9,1.1]", (0.9, 1.1)),
    ("1.25", (0.8, 1.25)),
])
def test_hydra_overrides_of_verls_block(override, expected):
    need("verl", extra="verl")
    from rollout_parity.adapters.verl import correction_config_from_verl
    from rollout_parity.adapters.verl.patches import ConfigRefusal, _configure
    from rollout_parity.check.verl_checks import compose_verl

    config = compose_verl("+rollout_parity.rollout_rejection=[seq_mean_k1]",
                          f"+rollout_parity.rollout_rejection_threshold={override}")
    if expected is None:
        assert config.rollout_parity.rollout_rejection_threshold == pytest.approx(0.91)
        with pytest.raises(FlagError, match=re.escape(QUOTING)):
            correction_config_from_verl(config)
        with pytest.raises(ConfigRefusal, match="got 0.91"):  # what verl's main hits: one line, no traceback
            _configure(config)
        return
    rule = correction_config_from_verl(config).rejection_rules[0]
    assert (rule.lower, rule.upper) == pytest.approx(expected)


def _trl_parse(argv, tmp_path):
    from trl import TrlParser

    from rollout_parity.adapters.trl import ParityGRPOConfig

    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--report_to", "none"]
    return TrlParser(ParityGRPOConfig).parse_args_and_config([*base, *argv])[0]


@pytest.mark.trl
def test_trls_command_line_and_yaml_file(tmp_path):
    need("trl", extra="trl")
    ok = _trl_parse(["--rollout_rejection", "seq_mean_k1", "--rollout_rejection_threshold", "0.9_1.1"], tmp_path)
    assert (ok.correction_config().rejection_rules[0].lower, ok.correction_config().rejection_rules[0].upper) == (
        0.9, 1.1)
    # The text 0.9_1 is the range [0.9, 1.0] here: 1 is not inside, refused (never a silent [0.91, 1.099]).
    with pytest.raises(FlagError, match="0 < lo < 1 < hi, got '0.9_1'"):
        _trl_parse(["--rollout_rejection", "seq_mean_k1", "--rollout_rejection_threshold", "0.9_1"], tmp_path)
    # A TRL YAML file (--config) is read by PyYAML: the unquoted range is the number 0.91, refused.
    path = tmp_path / "grpo.yaml"
    path.write_text(_yaml_block("0.9_1"))
    with pytest.raises(FlagError, match="got 0.91"):
        _trl_parse(["--config", str(path)], tmp_path)
    path.write_text(_yaml_block("[0.9, 1.1]"))
    rule = _trl_parse(["--config", str(path)], tmp_path).correction_config().rejection_rules[0]
    assert (rule.lower, rule.upper) == (0.9, 1.1)


def test_the_launchers_command_line(capsys):
    from rollout_parity.launcher import correction_from_args, main, parse_args

    args = parse_args(["--rollout_rejection", "seq_mean_k1", "--rollout_rejection_threshold", "0.9_1.1", "x.py"])
    rule = correction_from_args(args).rejection_rules[0]
    assert (rule.lower, rule.upper) == (0.9, 1.1)
    assert main(["--rollout_rejection", "seq_mean_k1", "--rollout_rejection_threshold", "0.9_1", "x.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0 < lo < 1 < hi" in err[0]


# ----------------------------------------------------------------------------- typos


def test_a_misspelt_key_of_a_mapping_names_the_closest_flag():
    with pytest.raises(FlagError) as info:
        CorrectionConfig.from_dict({"rollout_importance_sampling_mod": "token_truncate"})
    assert str(info.value) == ("unknown flag rollout_importance_sampling_mod "
                               "(did you mean 'rollout_importance_sampling_mode'?)")
    with pytest.raises(FlagError, match="unknown flag nonsense; the flags are rollout_importance_sampling_mode, "):
        CorrectionConfig.from_dict({"nonsense": 1})
    with pytest.raises(FlagError, match=r"unknown preset 'tis_srs_k2' \(did you mean 'tis_srs_k3'\?\)"):
        CorrectionConfig.preset("tis_srs_k2")
    # a framework's block names the keys as the user wrote them
    with pytest.raises(FlagError) as info:
        refuse_unknown(["fp32_lm_hed", "preset"], [*CorrectionConfig.field_names(), "preset"], where="block.")
    assert str(info.value) == "unknown flag block.fp32_lm_hed (did you mean 'block.fp32_lm_head'?)"


@pytest.mark.verl
def test_verls_block_names_the_closest_key_with_its_prefix():
    need("verl", extra="verl")
    from rollout_parity.adapters.verl import correction_config_from_verl
    from rollout_parity.check.verl_checks import compose_verl

    for typo, meant in (("rollout_importance_sampling_mod", "rollout_importance_sampling_mode"),
                        ("presett", "preset")):
        with pytest.raises(FlagError, match=rf"unknown flag rollout_parity\.{typo} \(did you mean "
                                            rf"'rollout_parity\.{meant}'\?\)"):
            correction_config_from_verl(compose_verl(f"+rollout_parity.{typo}=token_truncate"))


@pytest.mark.trl
@pytest.mark.parametrize("typo,meant", [
    ("--rollout_importance_sampling_mod", "--rollout_importance_sampling_mode"),  # argparse took this before
    ("--rollout_importance_sampling_treshold", "--rollout_importance_sampling_threshold"),
    ("--fp32_lm_hed", "--fp32_lm_head"),
    ("--rollout-importance-sampling-mod", "--rollout-importance-sampling-mode"),
])
def test_trls_parser_refuses_a_near_miss_of_a_shared_flag_in_one_line(typo, meant, tmp_path):
    need("trl", extra="trl")
    err = io.StringIO()
    with pytest.raises(SystemExit) as info, redirect_stderr(err):
        _trl_parse([typo, "token_truncate"], tmp_path)
    assert info.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and f"unknown option {typo} (did you mean {meant!r}?)" in lines[0], lines


@pytest.mark.trl
def test_a_typo_after_the_script_under_the_launcher(tmp_path, capsys):
    """An unmodified script's ``TrlParser`` parses the launcher's ``GRPOConfig``: the typo is refused there."""
    need("trl", extra="trl")
    from rollout_parity.cli import main

    script = tmp_path / "grpo.py"
    script.write_text("from trl import GRPOConfig, TrlParser\n"
                      "TrlParser((GRPOConfig,)).parse_args_and_config()\n")
    code = main(["launch", "--preset", "tis_srs_k3", str(script), "--output_dir", str(tmp_path), "--use_cpu", "true",
                 "--rollout_importance_sampling_mod", "token_mask"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown option --rollout_importance_sampling_mod (did you mean " \
                               "'--rollout_importance_sampling_mode'?)" in err[0], err


@pytest.mark.trl
def test_trls_own_options_keep_trls_parsing(tmp_path):
    """Only the shared flags lose argparse's prefix matching; an abbreviation of TRL's own option is TRL's
    business (argparse takes it, as without rollout-parity)."""
    need("trl", extra="trl")
    args = _trl_parse(["--vllm_importance_sampling_mod", "token_truncate"], tmp_path)
    assert args.vllm_importance_sampling_mode == "token_truncate"


@pytest.mark.trl
def test_trls_help_says_how_each_shared_flag_relates_to_trls_own(capsys, tmp_path):
    need("trl", extra="trl")
    with pytest.raises(SystemExit):
        _trl_parse(["--help"], tmp_path)
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--cast_lm_head_to_fp32 false" in help_text  # fp32_lm_head's: it wins over TRL's own
    assert ("vllm_importance_sampling_mode/_clip_max/_clip_min configure the same ratio (importance_sampling_ratio): "
            "with a correction flag set, setting them too is refused") in help_text
    assert "handed to TRL as its off_policy_mask_threshold: setting both is refused" in help_text
    # ... and TRL's own options say it too, in their own help (the parser's, as --help prints it)
    from trl import TrlParser

    from rollout_parity.adapters.trl import ParityGRPOConfig

    actions = TrlParser(ParityGRPOConfig)._option_string_actions  # noqa: SLF001 - argparse's own table
    same_ratio = "The shared flags rollout_importance_sampling_mode/_threshold/_threshold_lower set this same ratio"
    for option, note in [("vllm_importance_sampling_mode", same_ratio), ("vllm_importance_sampling_clip_min", same_ratio),
                         ("cast_lm_head_to_fp32", "--fp32_lm_head true turns this on and wins")]:
        assert f"[rollout-parity] {note}" in actions[f"--{option}"].help, option
    assert "setting this too is refused. (default: sequence_mask)" in help_text  # printed at TRL's option


@pytest.mark.parametrize("argv,meant", [
    (["--rollout_importance_sampling_mod", "token_truncate", "x.py"], "--rollout_importance_sampling_mode"),
    (["--fp32_lm", "x.py"], "--fp32_lm_head"),
    (["--presett", "tis_srs_k3", "x.py"], "--preset"),
])
def test_the_launcher_refuses_a_typo_in_one_line(argv, meant, capsys):
    from rollout_parity.cli import main

    with pytest.raises(SystemExit) as info:
        main(["launch", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rollout-parity launch: unknown option {argv[0]} (did you mean {meant!r}?); "
                   "see rollout-parity launch --help"]


@pytest.mark.parametrize("argv, message", [
    (["--fp32_lm_head", "ture", "train.py"],
     "rollout-parity launch: --fp32_lm_head takes true or false, got 'ture' (and 'ture' is no script either: "
     "write --fp32_lm_head true|false, then the script)"),
    (["--rollout_importance_sampling_mode", "token_truncate", "missing.py", "--lr", "1"],
     "rollout-parity launch: no script 'missing.py' (no such file; for a module, -m package.module)"),
])
def test_a_mistyped_switch_or_a_missing_script_is_one_line_before_anything_loads(argv, message, capsys, monkeypatch,
                                                                                 tmp_path):
    import sys as _sys

    from rollout_parity.launcher import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('the script ran')\n")
    monkeypatch.delitem(_sys.modules, "trl", raising=False)  # nothing imports TRL before the refusal
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [message]
    assert "trl" not in _sys.modules
