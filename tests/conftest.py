import os
import random
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    # Run the Triton kernels in Triton's CPU interpreter (must be set before triton.jit runs).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Fresh random inputs every run; the run's seed is printed in pytest's header so a failure
# can be replayed with FP4MOE_SEED=<seed>.
RUN_SEED = int(os.environ.get("FP4MOE_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"fp4moe: FP4MOE_SEED={RUN_SEED}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compile_ahead_off(monkeypatch):
    """On the GPU a layer shape's first call compiles the kernels of every token-count bucket
    (``launch.compile_layer_once``): seconds for each of the suite's many shapes. Off, except in
    the tests of it, which turn it on."""
    if torch.cuda.is_available():
        from fp4moe_ops.backends.triton_moe import launch

        monkeypatch.setattr(launch, "COMPILE_AHEAD", False)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    torch.manual_seed(RUN_SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def hf_logs(caplog):
    """caplog for fp4moe's log lines, which go through transformers.logging (logger
    ``transformers.fp4moe``; Transformers' loggers do not propagate to the root logger by default)."""
    import logging

    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO, logger="transformers.fp4moe"):
            yield caplog
    finally:
        hf_logging.disable_propagation()
