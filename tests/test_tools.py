"""The checks in tools/ that run without their optional dependencies: how ``check_vllm_load`` tells a
save's defect from vLLM's own rounding, on a stand-in for a loaded vLLM model (vLLM itself is not
installed for the suite)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import check_vllm_load as check  # noqa: E402


class Loaded(torch.nn.Module):
    """What vLLM's loader leaves: a router weight held in bfloat16, a packed weight as uint8."""

    def __init__(self, router: torch.Tensor, packed: torch.Tensor):
        super().__init__()
        self.gate = torch.nn.Module()
        self.gate.weight = torch.nn.Parameter(router, requires_grad=False)
        self.proj = torch.nn.Module()
        self.proj.weight = torch.nn.Parameter(packed, requires_grad=False)


def row(model, files) -> dict:
    r = check.compare(model, files) | dict(label="save")
    return r | dict(failures=check.failures(r))


def test_a_float32_router_rounded_to_vllms_bfloat16_is_named_not_failed():
    router = torch.randn(8, 16)  # random float32: most values need more than bf16's 8 mantissa bits
    packed = torch.randint(0, 256, (4, 8), dtype=torch.uint8)
    files = {"gate.weight": router, "proj.weight": packed}
    assert not torch.equal(router.bfloat16().float(), router)  # the cast does round here
    r = row(Loaded(router.bfloat16(), packed.clone()), files)
    assert r["casts"] == [("gate.weight", "float32", "bfloat16", False)]  # named: rounded by vLLM
    assert r["mismatched"] == [] and r["failures"] == []


def test_a_parameter_that_differs_after_vllms_rounding_is_a_defect():
    router = torch.randn(8, 16)
    packed = torch.randint(0, 256, (4, 8), dtype=torch.uint8)
    files = {"gate.weight": router, "proj.weight": packed}
    wrong_router = router.bfloat16().clone()
    wrong_router[3, 5] += 1  # one value off by more than any rounding
    wrong_bytes = packed.clone()
    wrong_bytes[0, 0] ^= 1
    for model, name in ((Loaded(wrong_router, packed.clone()), "gate.weight"),
                        (Loaded(router.bfloat16(), wrong_bytes), "proj.weight")):
        r = row(model, files)
        assert r["mismatched"] == [name]
        assert r["failures"] == ["parameters differing from the files: 1"]
