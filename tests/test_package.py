"""The package's face: a lazy __init__ whose every public name resolves, and formats that import without
the compiler."""

import subprocess
import sys

import comera_compile as cc


def test_every_public_name_resolves_to_what_its_module_defines():
    import importlib

    for name in cc.__all__:
        value = getattr(cc, name)
        module = importlib.import_module(cc._EXPORTS[name])
        assert value is getattr(module, name), name
    assert set(cc.__all__) <= set(dir(cc))


def test_an_unknown_name_is_an_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cc.nope  # noqa: B018


def test_importing_the_formats_and_layers_does_not_import_the_compiler():
    code = ("import sys, comera_compile.tt, comera_compile.layers, comera_compile.embedding\n"
            "import comera_compile as cc\n"
            "cc.TTLinear(64, 64)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('comera_compile.backend', "
            "'comera_compile.passes', 'comera_compile.rank_adaptive', 'torch._inductor.compile_fx'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_constant_mark_is_the_one_torch_compile_sets():
    import torch

    from comera_compile.tt import constant_under_compile

    def ours():
        return 1

    def theirs():
        return 1

    assert vars(constant_under_compile(ours)) == vars(torch.compiler.assume_constant_result(theirs)) != {}
