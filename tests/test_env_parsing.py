"""fp4moe's environment variables parse one way (:mod:`fp4moe_ops.env`): a value not understood is a
ValueError naming the variable and the value where it is read, never silently taken as unset."""

import pytest

import fp4moe_autoload
from fp4moe_ops.env import OFF_WORDS, ON_WORDS, env_choice, env_switch


@pytest.mark.parametrize("raw,want", [("1", True), (" TRUE ", True), ("yes", True), ("On", True), ("0", False),
                                      ("false", False), ("NO", False), ("off", False), ("", None)])
def test_switch_words(monkeypatch, raw, want):
    monkeypatch.setenv("FP4MOE_TEST_SWITCH", raw)
    assert env_switch("FP4MOE_TEST_SWITCH") is want


@pytest.mark.parametrize("raw", ["2", "ture", "enabled"])
def test_switch_refuses_what_it_does_not_understand(monkeypatch, raw):
    monkeypatch.setenv("FP4MOE_TEST_SWITCH", raw)
    with pytest.raises(ValueError, match=rf"FP4MOE_TEST_SWITCH={raw!r} is not understood"):
        env_switch("FP4MOE_TEST_SWITCH", default=True)


def test_choice(monkeypatch):
    monkeypatch.delenv("FP4MOE_TEST_CHOICE", raising=False)
    assert env_choice("FP4MOE_TEST_CHOICE", ("a", "b"), "a") == "a"
    monkeypatch.setenv("FP4MOE_TEST_CHOICE", " B ")
    assert env_choice("FP4MOE_TEST_CHOICE", ("a", "b"), "a") == "b"
    monkeypatch.setenv("FP4MOE_TEST_CHOICE", "c")
    with pytest.raises(ValueError, match=r"FP4MOE_TEST_CHOICE='c' is not understood: it takes 'a' or 'b'"):
        env_choice("FP4MOE_TEST_CHOICE", ("a", "b"), "a")


def test_the_start_up_hook_reads_the_same_words(monkeypatch):
    # the hook cannot import fp4moe_ops (torch) at start-up, nor refuse to start: it takes the same
    # words, and leaves anything else on
    for word in ON_WORDS + OFF_WORDS:
        monkeypatch.setenv(fp4moe_autoload.ENV, word.upper())
        assert fp4moe_autoload.enabled() is (word in ON_WORDS), word
    monkeypatch.setenv(fp4moe_autoload.ENV, "maybe")
    assert fp4moe_autoload.enabled()


@pytest.mark.parametrize("name,raw", [("FP4MOE_GLUON", "2"), ("FP4MOE_GLUON", "ture"),
                                      ("FP4MOE_COMPILE_AHEAD", "maybe")])
def test_backend_switches_not_understood_are_refused(monkeypatch, name, raw):
    from fp4moe_ops import prepare_experts, quantize_moe_weights, resolve_gpt_oss_backend
    import torch

    weights = quantize_moe_weights(torch.randn(2, 64, 32), torch.randn(2, 32, 32))
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=rf"{name}={raw!r} is not understood: it takes 1/true/yes/on or "):
        prepare_experts(weights, "reference")
    with pytest.raises(ValueError, match=rf"{name}={raw!r} is not understood"):
        resolve_gpt_oss_backend("auto", "cpu")
    for word in ("0", "false", "Off", "1", "yes"):
        monkeypatch.setenv(name, word)
        assert prepare_experts(weights, "reference").backend == "reference"


@pytest.mark.parametrize("raw,want", [("off", False), ("0", False), ("yes", True), ("", True)])
def test_compile_ahead_switch_read_at_the_first_launch(monkeypatch, raw, want):
    """FP4MOE_COMPILE_AHEAD is read when the kernels first launch, with the same words as every
    switch (unset or empty: on); a value not understood is refused there too, not taken as on."""
    from fp4moe_ops.backends.triton_moe import launch

    monkeypatch.setattr(launch, "COMPILE_AHEAD", None)
    monkeypatch.setenv("FP4MOE_COMPILE_AHEAD", raw)
    assert launch._compile_ahead() is want
    monkeypatch.setattr(launch, "COMPILE_AHEAD", None)
    monkeypatch.setenv("FP4MOE_COMPILE_AHEAD", "of")
    with pytest.raises(ValueError, match="FP4MOE_COMPILE_AHEAD='of' is not understood"):
        launch._compile_ahead()


@pytest.mark.parametrize("raw", ["0", "false", "OFF"])
def test_gluon_switch_takes_the_same_words(monkeypatch, raw):
    """FP4MOE_GLUON's off words all turn the Gluon kernels off, naming the setting as the user wrote it."""
    import torch
    from fp4moe_ops.backends.triton_moe import launch

    monkeypatch.setenv("FP4MOE_GLUON", raw)
    assert launch._gluon_check(torch.empty(1, 8, dtype=torch.bfloat16)) == f"FP4MOE_GLUON={raw}"


def test_fp4moe_mxfp4_typo_is_refused(monkeypatch):
    from hf_integration.mxfp4_quantizer import supported, wants_transformers_quantizer

    if not supported():
        pytest.skip("fp4moe's MXFP4 quantizer is not registered on this Transformers")
    from transformers import Mxfp4Config

    monkeypatch.setenv("FP4MOE_MXFP4", "transformer")
    with pytest.raises(ValueError, match=r"FP4MOE_MXFP4='transformer' is not understood: it takes 'fp4moe' or "
                                         r"'transformers'"):
        wants_transformers_quantizer(Mxfp4Config())
    monkeypatch.setenv("FP4MOE_MXFP4", "Transformers")
    assert wants_transformers_quantizer(Mxfp4Config())
    monkeypatch.setenv("FP4MOE_MXFP4", "fp4moe")
    assert not wants_transformers_quantizer(Mxfp4Config())
