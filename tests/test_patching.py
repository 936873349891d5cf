"""The shared patch layer (adapters/_patching.py) on stand-in modules.

Identity after revert (bit for bit, including attributes the owner did not hold itself),
idempotence, refusal to stack on a foreign wrapper, caller modules that imported a name by
value, and the import hook for modules imported after ``apply``.
"""

from __future__ import annotations

import functools
import sys
import textwrap
import types

import pytest

from rollout_parity.framework_api import FrameworkAPIError
from rollout_parity.adapters._patching import MARK, ModulePatcher, PatchPoint, Patches, is_ours, wrapper


def _plus_one(original, *args, **kwargs):
    return original(*args, **kwargs) + 1


class Base:
    def value(self, x):
        return x


class Child(Base):
    pass


def test_wrapper_keeps_the_original_reachable_and_marks_itself():
    def f(x: int) -> int:
        """doc"""
        return 2 * x

    w = wrapper(f, _plus_one)
    assert w(3) == 7 and w.__wrapped__ is f and w.__name__ == "f" and w.__doc__ == "doc"
    assert getattr(w, MARK) is True and is_ours(w) and not is_ours(f)


def test_a_coroutine_function_gets_a_coroutine_wrapper_with_its_attributes():
    """verl dispatches on ``inspect.iscoroutinefunction`` and reads what ``@register`` set on the method."""
    import asyncio
    import inspect

    async def f(x):
        return 2 * x

    f.dispatch = "ONE_TO_ALL"

    async def plus_one(original, *args):
        return await original(*args) + 1

    w = wrapper(f, plus_one)
    assert inspect.iscoroutinefunction(w) and w.__wrapped__ is f and w.dispatch == "ONE_TO_ALL" and is_ours(w)
    assert asyncio.run(w(3)) == 7
    assert not inspect.iscoroutinefunction(wrapper(lambda x: x, _plus_one))


def test_revert_removes_what_the_owner_did_not_hold_itself():
    patches = Patches()
    patches.wrap(Child, "value", _plus_one, dotted="Child.value")
    assert "value" in vars(Child) and Child().value(1) == 2
    patches.revert()
    assert "value" not in vars(Child) and Child.value is Base.value  # inherited again, not copied down


def test_instance_patch_and_revert_leave_the_instance_as_it_was():
    obj, patches = Base(), Patches()
    patches.wrap(obj, "value", _plus_one, dotted="Base.value")
    assert obj.value(1) == 2 and Base().value(1) == 1
    patches.revert()
    assert "value" not in vars(obj) and obj.value(1) == 1


def test_wrap_is_idempotent():
    patches = Patches()
    first = patches.wrap(Child, "value", _plus_one, dotted="Child.value")
    assert patches.wrap(Child, "value", _plus_one, dotted="Child.value") is first and len(patches) == 1
    assert first.__wrapped__ is Base.value
    patches.revert()


def test_refuses_to_stack_on_a_foreign_wrapper():
    module = types.ModuleType("stand_in")

    def f():
        return 1

    @functools.wraps(f)
    def someone_elses(*a):
        return f(*a)

    module.f = someone_elses
    with pytest.raises(RuntimeError, match="already replaced by .*someone_elses.*refusing to stack"):
        Patches().wrap(module, "f", _plus_one, dotted="stand_in.f")
    obj = Base()
    obj.value = lambda x: x  # an instance's own override of its class's method
    with pytest.raises(RuntimeError, match="refusing to stack"):
        Patches().wrap(obj, "value", _plus_one, dotted="Base.value")


def test_replace_and_previous_record_plain_values():
    obj, patches = types.SimpleNamespace(flag=False), Patches()
    patches.replace(obj, "flag", True)
    patches.replace(obj, "flag", "again")
    assert patches.previous(obj, "flag") is False and patches.holds(obj, "flag")
    patches.revert()
    assert obj.flag is False


def _make_package(tmp_path, name: str) -> None:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "defs.py").write_text(textwrap.dedent("""
        def f(x):
            return x

        class Engine:
            def step(self, x):
                return x

        def register(fn):  # the framework's own decorator (verl's @register)
            import functools

            @functools.wraps(fn)
            def inner(*args, **kwargs):
                return fn(*args, **kwargs)
            return inner

        class Worker:
            @register
            def update(self, x):
                return x
    """))
    (pkg / "caller.py").write_text(f"from {name}.defs import f\n")
    (pkg / "late.py").write_text(textwrap.dedent("""
        def g(x):
            return 10 * x
    """))


@pytest.fixture
def package(tmp_path, monkeypatch):
    name = f"stand_in_{tmp_path.name.replace('-', '_')}"
    _make_package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def _patcher(name: str, *extra: PatchPoint) -> ModulePatcher:
    points = [PatchPoint(f"{name}.defs", "f", _plus_one, callers=(f"{name}.caller",), eager=True),
              PatchPoint(f"{name}.defs", "Engine.step", _plus_one, eager=True), *extra]
    return ModulePatcher("Stand-in", points, distributions=("no-such-dist",), tested=">=1", extra="none")


def test_module_patcher_patches_callers_and_reverts_bit_for_bit(package):
    import importlib

    defs = importlib.import_module(f"{package}.defs")
    caller = importlib.import_module(f"{package}.caller")
    f, step = defs.f, defs.Engine.__dict__["step"]
    patcher = _patcher(package)
    patcher.apply()
    assert patcher.is_applied() and caller.f is defs.f and caller.f(1) == 2 and defs.Engine().step(1) == 2
    patched = defs.f
    patcher.apply()  # idempotent
    assert defs.f is patched and len(patcher.patches) == 3
    patcher.revert()
    assert defs.f is f and caller.f is f and defs.Engine.__dict__["step"] is step
    assert not patcher.is_applied() and patcher.hook not in sys.meta_path


def test_module_patcher_patches_a_module_when_it_is_imported(package):
    import importlib

    late = PatchPoint(f"{package}.late", "g", _plus_one)
    patcher = _patcher(package, late)
    patcher.apply()
    try:
        assert f"{package}.late" not in sys.modules and f"{package}.late" in patcher.hook.watch
        module = importlib.import_module(f"{package}.late")
        assert is_ours(module.g) and module.g(1) == 11
        patcher.revert()
        assert module.g(1) == 10 and not is_ours(module.g)
    finally:
        patcher.revert()


def test_missing_name_is_a_framework_api_error_and_nothing_stays_patched(package):
    import importlib

    defs = importlib.import_module(f"{package}.defs")
    f = defs.f
    patcher = _patcher(package, PatchPoint(f"{package}.defs", "Engine.no_such_method", _plus_one, eager=True))
    with pytest.raises(FrameworkAPIError, match=r"defs\.Engine\.no_such_method.*tested with Stand-in >=1"):
        patcher.apply()
    assert defs.f is f and len(patcher.patches) == 0  # all or nothing


def test_a_patcher_of_lazy_points_only_is_applied_while_it_watches(package):
    import importlib

    patcher = ModulePatcher("Stand-in", [PatchPoint(f"{package}.late", "g", _plus_one)],
                            distributions=("no-such-dist",), tested=">=1", extra="none")
    assert not patcher.is_applied()
    patcher.apply()
    try:
        assert patcher.is_applied() and is_ours(importlib.import_module(f"{package}.late").g)
    finally:
        patcher.revert()
    assert not patcher.is_applied()


def test_the_framework_s_own_decorator_is_not_a_foreign_wrapper(package):
    """verl decorates its worker methods (``@register``); wrapping them is wrapping verl, not stacking on a
    stranger. A wrapper from outside the framework's package is still refused."""
    import importlib

    defs = importlib.import_module(f"{package}.defs")
    registered = defs.Worker.__dict__["update"]
    patches = Patches()
    patched = patches.wrap(defs.Worker, "update", _plus_one, dotted="defs.Worker.update")
    assert defs.Worker().update(1) == 2 and patched.__wrapped__ is registered
    patches.revert()
    assert defs.Worker.__dict__["update"] is registered

    @functools.wraps(registered)
    def someone_elses(*a):
        return registered(*a)

    defs.Worker.update = someone_elses
    with pytest.raises(RuntimeError, match="refusing to stack"):
        Patches().wrap(defs.Worker, "update", _plus_one, dotted="defs.Worker.update")


def test_patched_wraps_for_the_block_only_and_a_nested_block_keeps_the_outer_wrapper():
    from rollout_parity.adapters._patching import patched

    module = types.ModuleType("stand_in")
    module.f = lambda x: x
    original = module.f
    with patched(module, "f", _plus_one, dotted="stand_in.f"):
        outer = module.f
        assert outer(1) == 2 and outer.__wrapped__ is original
        with patched(module, "f", _plus_one, dotted="stand_in.f"):
            assert module.f is outer and module.f(1) == 2  # not stacked
        assert module.f is outer  # the inner block had nothing to undo
    assert module.f is original
