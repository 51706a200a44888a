"""The Hopper kernels on every Triton release current torch pins (3.6 for torch 2.11 to 3.9 for
2.15), checked without a GPU: every kernel variant a layer and an NVFP4 linear launch compiles for
sm_90 on the installed Triton (Triton compiles without a device; its wheel ships ptxas), and the
launcher says which kernels run and why it falls back.

CI runs this file under the oldest and the newest supported torch, so under Triton 3.6 and 3.9;
``FP4MOE_COMPILE_TRITON=/path/to/a/triton/site`` compiles under another one (put first on
``PYTHONPATH`` of the compiling subprocess).
"""

import os
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import torch

triton_moe = pytest.importorskip("fp4moe_ops.backends.triton_moe")
if triton_moe.triton is None:  # pragma: no cover
    pytest.skip("triton not installed", allow_module_level=True)

from fp4moe_ops import linear  # noqa: E402
from fp4moe_ops.backends.triton_moe import launch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _compile(*args: str, tool: str = "compile_ahead_cpu.py") -> subprocess.CompletedProcess:
    """``tools/compile_ahead_cpu.py`` (or another ``tool``) in a subprocess with an empty Triton
    cache (a cached kernel would not be compiled again)."""
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="fp4moe-sm90-"), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    extra = os.environ.get("FP4MOE_COMPILE_TRITON")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(ROOT / "tools" / tool), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("shape", ["small", "deepseek"])
def test_every_layer_kernel_variant_compiles_for_sm90(shape):
    # the plans of every token-count bucket (Gluon decode and prefill included, the CUDA check
    # lifted for CPU tensors), then calls at bucket edges must find their kernels compiled. The
    # two shapes differ in the Gluon decode's ring (I % 512) and the tile widths
    done = _compile("serial", "--shape", shape, "--check-tokens", "1,3,9,300")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "nothing compiled" in done.stdout
    assert ", 15 kernels in" in done.stdout, done.stdout  # routing, sum, 2 single-role GEMMs x buckets, Gluon


def test_relaunch_launches_what_triton_launches():
    # fp4moe_ops/relaunch.py skips Triton's per-call work for kinds of calls seen before: every launch
    # of MoE calls (decode and prefill, NVFP4 and gpt-oss's MXFP4), an NVFP4 linear and the routing
    # ops must reach the same compiled kernel with the same arguments as through Triton (recorded by
    # a stand-in launcher), the second time without Triton's run; and arguments that change Triton's
    # specialization (alignment, ints 1 / 16 / 2^31, dtypes, None, constexprs) its own choice
    done = _compile("--tokens", "1,9,300", tool="relaunch_cpu.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "relaunch: same launches as Triton's" in done.stdout, done.stdout
    assert done.stdout.count("relaunched the same: True; Triton's run called on the fast pass: 0") == 10, done.stdout
    assert "each relaunched as Triton launches it" in done.stdout, done.stdout


def test_every_linear_kernel_variant_compiles_for_sm90():
    done = _compile("serial", "--linear", "--shape", "small")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiled nothing" in done.stdout, done.stdout


def test_gluon_renames_resolve_to_gluon_builtins():
    # each name the kernels use is one of this Triton's Gluon builtins (an alias of a function that
    # raises "has been removed" would compile-fail; the sm_90 compile above catches that too)
    from fp4moe_ops.backends.triton_moe import gluon_api

    for fn in (gluon_api.tma_load, gluon_api.thread_barrier, gluon_api.reinterpret):
        assert getattr(fn, "__triton_builtin__", False), fn
    assert "removed" not in (gluon_api.tma_load.__doc__ or "")


def _flat_words(t):  # (a view function for the test below)
    return t.reshape(-1).view(torch.int32)


def test_descriptors_equal_gluons_own_and_are_checked_per_geometry():
    # descriptors.descriptor copies a descriptor Gluon made and checked for the same geometry: every
    # field must equal what Gluon's from_tensor makes for this view, the base is this view, and a view
    # of another geometry (an address off 16 bytes, another shape or stride, dtype, box) gets its own
    from dataclasses import fields

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4moe_ops.backends.triton_moe import descriptors

    def gluons(view, box, swizzle=0):
        layout = descriptors.shared_layout(swizzle, 8 * view.element_size(), view.dim())
        return TensorDescriptor.from_tensor(view, box, layout)

    storage = torch.zeros(4 * 64 * 64 + 64, dtype=torch.uint8)
    views = {"base": lambda: storage[:4 * 64 * 64].view(4, 64, 64),
             "another buffer": lambda: torch.zeros(4, 64, 64, dtype=torch.uint8),
             "transposed": lambda: storage[:4 * 64 * 64].view(64, 4, 64).permute(1, 0, 2),
             "int16": lambda: storage[:4 * 64 * 64].view(torch.int16).view(4, 64, 32),
             "another shape": lambda: storage[:2 * 64 * 64].view(2, 64, 64)}
    for label, make in views.items():
        for box in ([1, 16, 64], [2, 32, 16]):
            for _ in range(2):  # (the second: copied from the first)
                view = make()
                got, want = descriptors.descriptor(view, box), gluons(view, box)
                assert got.base is view, label
                for f in fields(TensorDescriptor):
                    if f.name != "base":
                        assert getattr(got, f.name) == getattr(want, f.name), (label, box, f.name)
    # view_descriptor: a view of a whole tensor, made once per geometry; copies get the tensor
    # itself in the view's dtype as base (what a launch reads of it: the address and dtype)
    from fp4moe_ops.backends.triton_moe.decode_v3 import gate_up_scale_view, scale_view
    from fp4moe_ops.backends.triton_moe.prefill_rs import _by_k_step, gate_up_boxes

    cases = [(_by_k_step, lambda: torch.zeros(96, 256, dtype=torch.bfloat16), [2, 64, 64], ()),  # (swizzle 128 below)
             (gate_up_boxes, lambda: torch.zeros(4, 128, 64, dtype=torch.int32), [2, 2, 32, 64], ()),
             (scale_view, lambda: torch.zeros(4, 128, 32, dtype=torch.uint8), [2, 1, 64, 4], (2,)),
             (gate_up_scale_view, lambda: torch.zeros(4, 128, 16, dtype=torch.uint8), [1, 2, 1, 32, 4], (16,)),
             (gate_up_scale_view, lambda: torch.zeros(4, 128, 16, dtype=torch.int8), [1, 1, 2, 16, 8], (32,))]
    for view_fn, make, box, view_args in cases:
        swizzle = 128 if view_fn is _by_k_step else 0
        for _ in range(2):
            tensor = make()
            got = descriptors.view_descriptor(view_fn, tensor, box, *view_args, swizzle=swizzle)
            want = gluons(view_fn(tensor, *view_args), box, swizzle)
            assert got.base.data_ptr() == tensor.data_ptr() and got.base.dtype == want.base.dtype, view_fn
            for f in fields(TensorDescriptor):
                if f.name != "base":
                    assert getattr(got, f.name) == getattr(want, f.name), (view_fn, f.name)
    # a view function that reaches its dtype only after a reshape the tensor itself could not take:
    # nothing kept, each call makes the view
    for _ in range(2):
        tensor = torch.zeros(128, 2, dtype=torch.uint8)
        got, want = descriptors.view_descriptor(_flat_words, tensor, [64]), gluons(_flat_words(tensor), [64])
        assert got.block_shape == want.block_shape and got.base.dtype == torch.int32
    # a caller's box list changed after its call does not change later copies
    box, view = [1, 8, 64], storage[:3 * 64 * 64].view(3, 64, 64)  # (a geometry not seen above)
    descriptors.descriptor(view, box)
    box[1] = 32
    assert descriptors.descriptor(view, [1, 8, 64]).block_shape == [1, 8, 64]
    # the caches keep no tensor: a weight and an activation seen once are freed with their last reference
    import gc
    import weakref

    weight, activation = torch.zeros(4, 256, 64, dtype=torch.int32), torch.zeros(3, 64, 64, dtype=torch.uint8)
    refs = [weakref.ref(weight), weakref.ref(activation)]
    descriptors.view_descriptor(gate_up_boxes, weight, [2, 2, 32, 64])
    descriptors.descriptor(activation, [1, 16, 64])
    del weight, activation
    gc.collect()
    assert all(ref() is None for ref in refs)
    descriptors.descriptor(storage[16:16 + 4 * 64 * 64].view(4, 64, 64), [1, 16, 64])  # (aligned: made)
    with pytest.raises(Exception):  # Gluon's own check on a misaligned address, never skipped by a copy
        descriptors.descriptor(storage[1:1 + 4 * 64 * 64].view(4, 64, 64), [1, 16, 64])


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    # the launch arguments use plain-Python copies of Triton's constexpr functions (host time)
    import triton

    from fp4moe_ops.relaunch import cdiv, next_power_of_2

    for n in list(range(0, 5000)) + [2 ** 31 - 1, 2 ** 31, 2 ** 40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 64, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.fixture
def hopper(monkeypatch):
    """A stand-in for a bf16 activation tensor on an H200 (only device, dtype and is_cuda are read),
    outside Triton's interpreter (which the CPU suite runs under)."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(launch, "_GLUON_STATUS", {})
    monkeypatch.setattr(launch, "_ANNOUNCED", set())
    monkeypatch.delenv("FP4MOE_GLUON", raising=False)
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.bfloat16)


def test_gluon_runs_on_hopper_with_a_supported_triton(hopper, monkeypatch):
    monkeypatch.setattr(launch.triton, "__version__", "3.9.0")
    assert launch.gluon_unavailable(hopper) is None


@pytest.mark.parametrize("change,needle", [
    (dict(version="3.10.0"), "Triton 3.10.0"),
    (dict(dtype=torch.float16), "float16"),
    (dict(capability=(8, 0)), "compute capability 8.0"),
    (dict(capability=(10, 0)), "compute capability 10.0"),
    (dict(env="0"), "FP4MOE_GLUON=0"),
])
def test_gluon_fallback_names_its_reason(hopper, monkeypatch, change, needle):
    monkeypatch.setattr(launch.triton, "__version__", change.get("version", "3.6.0"))
    if "capability" in change:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: change["capability"])
    if "env" in change:
        monkeypatch.setenv("FP4MOE_GLUON", change["env"])
    x = types.SimpleNamespace(**{**vars(hopper), "dtype": change.get("dtype", torch.bfloat16)})
    assert needle in launch.gluon_unavailable(x)


def test_an_untested_triton_can_be_tried(hopper, monkeypatch):
    monkeypatch.setattr(launch.triton, "__version__", "3.10.0")
    monkeypatch.setenv("FP4MOE_GLUON", "1")
    assert launch.gluon_unavailable(hopper) is None


def test_a_hopper_fallback_warns_once_and_logs(hopper, monkeypatch, caplog):
    monkeypatch.setattr(launch.triton, "__version__", "3.10.0")
    with caplog.at_level("INFO", logger="fp4moe"), pytest.warns(UserWarning, match="Triton 3.10.0") as caught:
        for _ in range(3):
            launch._announce_once(("moe", 0), hopper, "the MoE layer", True)
    assert len([w for w in caught if "fp4moe" in str(w.message)]) == 1
    assert "single-role kernels, without Gluon: Triton 3.10.0" in caplog.text


def test_the_fast_path_is_logged_at_info_without_a_warning(hopper, monkeypatch, caplog):
    monkeypatch.setattr(launch.triton, "__version__", "3.8.0")
    with caplog.at_level("INFO", logger="fp4moe"), warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._announce_once(("moe", 0), hopper, "the MoE layer", True)
    assert "the MoE layer runs Triton 3.8.0's kernels with Gluon" in caplog.text


def test_a_chosen_or_hardware_fallback_does_not_warn(hopper, monkeypatch, caplog):
    # FP4MOE_GLUON=0 is the user's choice; a non-Hopper GPU has no Gluon path to fall from
    monkeypatch.setattr(launch.triton, "__version__", "3.9.0")
    monkeypatch.setenv("FP4MOE_GLUON", "0")
    with caplog.at_level("INFO", logger="fp4moe"), warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._announce_once(("moe", 1), hopper, "the MoE layer", True)
        monkeypatch.delenv("FP4MOE_GLUON")
        monkeypatch.setattr(launch, "_GLUON_STATUS", {})
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
        launch._announce_once(("moe", 2), hopper, "the MoE layer", True)
    assert "FP4MOE_GLUON=0" in caplog.text and "compute capability 8.0" in caplog.text


def test_kernel_family_per_bucket(hopper, monkeypatch):
    # DeepSeek-V3's layer: Gluon decode up to 6 rows per expert, the wgmma kernels between, the
    # Gluon prefill from 64 rows per expert; the single-role kernels everywhere without Gluon
    monkeypatch.setattr(launch.triton, "__version__", "3.9.0")
    family = lambda tokens: launch.kernel_family(hopper, tokens * 8, 256, 7168, 2048)  # noqa: E731
    assert [family(t) for t in (1, 8, 64, 512, 2048, 8192)] == \
        ["gluon-decode", "gluon-decode", "gluon-decode", "triton-wgmma", "gluon-prefill", "gluon-prefill"]
    monkeypatch.setenv("FP4MOE_GLUON", "0")
    monkeypatch.setattr(launch, "_GLUON_STATUS", {})
    assert {family(t) for t in (1, 8, 64, 512, 2048, 8192)} == {"triton-wgmma"}


def test_linear_fallback_to_the_reference_path_warns_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(linear, "_ANNOUNCED", set())
    x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="slow reference path.*needs TMA"):
        linear._announce_once(x, "the Triton linear needs TMA (compute capability 9.0+)")
    with caplog.at_level("INFO", logger="fp4moe"), warnings.catch_warnings():
        warnings.simplefilter("error")
        linear._announce_once(x, "the Triton linear needs TMA (compute capability 9.0+)")  # once
        linear._announce_once(x, None)
    assert "NVFP4 linears on cuda:0 run Triton" in caplog.text
