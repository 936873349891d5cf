"""The ``precision`` flag: its spellings, its refusals, and the engine kwargs it writes."""

from __future__ import annotations

import pytest
import torch

from rollout_parity import CorrectionConfig
from rollout_parity.core.config import FlagError, flag_from_text
from rollout_parity.core.precision import FP16_MAX, PRECISIONS, engine_dtype, normalize_precision, \
    precision_of_dtype, torch_dtype
from rollout_parity.engines.vllm.recipe import vllm_parity_kwargs, vllm_serve_flags


@pytest.mark.parametrize("text, expected", [
    ("bf16", "bf16"), ("bfloat16", "bf16"), ("BF16", "bf16"), ("fp16", "fp16"), ("float16", "fp16"),
    ("half", "fp16"), ("fp32", "fp32"), ("float32", "fp32"), (None, None), ("null", None), ("", None)])
def test_every_spelling_a_framework_writes_is_one_precision(text, expected):
    assert normalize_precision(text) == expected
    assert CorrectionConfig(precision=text).precision == expected


def test_torch_dtypes_map_both_ways():
    for p in PRECISIONS:
        assert precision_of_dtype(torch_dtype(p)) == p
        assert getattr(torch, engine_dtype(p)) is torch_dtype(p)
    assert precision_of_dtype("auto") is None and precision_of_dtype(None) is None
    assert FP16_MAX == torch.finfo(torch.float16).max


@pytest.mark.parametrize("bad", ["int8", "fp8", "auto", 16, True])
def test_an_unknown_precision_is_refused_naming_the_flag(bad):
    with pytest.raises(FlagError, match=r"^precision: unknown precision"):
        CorrectionConfig(precision=bad)


def test_the_flag_reads_from_text_as_the_command_lines_give_it():
    assert CorrectionConfig(precision=flag_from_text("precision", "float16")).precision == "fp16"
    assert CorrectionConfig(precision=flag_from_text("precision", "null")).precision is None


def test_the_recipe_sets_the_engine_dtype_and_refuses_a_contradicting_one():
    assert "dtype" not in vllm_parity_kwargs()
    assert vllm_parity_kwargs(precision="fp16")["dtype"] == "float16"
    assert vllm_parity_kwargs(precision="bf16", dtype="bfloat16")["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="override dtype='bfloat16' contradicts .*precision flag"):
        vllm_parity_kwargs(precision="fp16", dtype="bfloat16")
    flags = vllm_serve_flags(precision="fp16", style="trl")
    assert flags[flags.index("--dtype") + 1] == "float16"
    assert "--dtype" not in vllm_serve_flags()


def test_the_refusal_names_the_flag_it_was_read_from():
    """The adapters read a framework's own key (``policy.precision``) through the same function."""
    with pytest.raises(ValueError, match=r"^policy\.precision: unknown precision 'int4'"):
        normalize_precision("int4", flag="policy.precision")
