"""One name per concept inside the packages (CONTRIBUTING.md, "Names"): the names the code has retired
for the experts' projections and their scales do not come back, and a checkpoint format's or
FlashInfer's own names appear only in the modules that read or write that format or call FlashInfer.

Names are searched in code, comments and docstrings alike (a docstring that says ``w13`` teaches
it again); ``alpha`` only as an identifier, since FlashInfer's ``alpha`` may be described anywhere.
"""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fp4moe_ops", "hf_integration")

# rule -> the retired names (now: gate_up / down, the gate_up / the down GEMM, gate_up_input_scale /
# down_input_scale, global_scale; see CONTRIBUTING.md)
RETIRED = {
    "w13/w2": re.compile(r"\b(?:w13\w*|w2(?:_\w+)?|[sg]13)\b"),
    "GEMM1/GEMM2": re.compile(r"gemm[12](?!\d)", re.IGNORECASE),
    "fc1/fc2": re.compile(r"\bfc[12](?:_\w+)?\b"),
    "checkpoint scale names": re.compile(r"(?:weight_scale_2|weight_global_scale)\b"),  # ..._weight_scale_2 too
    # the kernel configs' keys and the launcher's locals numbered by GEMM (now _GATE_UP / _DOWN)
    "numbered GEMM keys": re.compile(r"\b(?:B[NK][12]|PIPELINED_MMA[12]|V3_STAGES1|b[nk][12]|desc[12]|grid[12])\b"),
}
ALPHA = "alpha"  # gpt-oss's constant is swiglu_alpha; a GEMM's output scale is output_scale

# Modules that may use a rule's names, and why: they read or write a checkpoint format (whose keys
# are ModelOpt's weight_scale_2, compressed-tensors' weight_global_scale, Mixtral's w1/w3/w2), hold
# a module whose state dict is the checkpoint (Transformers loads the files into it by key), or
# speak FlashInfer's API (its fc1/fc2 tensors, quant_scales and alpha). Only the modules that use
# them today are listed (the last test keeps it so): another format module that comes to need
# them is added here.
CHECKPOINT_FORMAT = {"checkpoint scale names"}
ALLOWED_FILES = {
    "fp4moe_ops/backends/flashinfer_cutlass.py": {"fc1/fc2", ALPHA},
    "fp4moe_ops/flashinfer_sim.py": {"fc1/fc2", ALPHA},
    "hf_integration/checkpoint_format.py": CHECKPOINT_FORMAT | {"w13/w2"},  # Mixtral's w1/w3/w2 leaves
    "hf_integration/tiny_models.py": CHECKPOINT_FORMAT | {"w13/w2"},  # writes checkpoints, Mixtral's too
    "hf_integration/load_plan.py": CHECKPOINT_FORMAT,
    "hf_integration/expert_conversion.py": CHECKPOINT_FORMAT,
    "hf_integration/quantizer.py": CHECKPOINT_FORMAT,
    "hf_integration/fused_linears.py": CHECKPOINT_FORMAT,  # the shards of a saved fused linear share one
    "hf_integration/llama4.py": CHECKPOINT_FORMAT,  # its experts' fused checkpoint tensors
    "hf_integration/gpt_oss.py": CHECKPOINT_FORMAT,  # NVFP4 gpt-oss holds ModelOpt's tensors as buffers
    "hf_integration/experts.py": CHECKPOINT_FORMAT,  # NVFP4Linear / FP8Linear hold the checkpoint's tensors
}
# Single lines elsewhere, each found by a piece of its text: (file, rule) -> pieces
ALLOWED_LINES = {
    # the input scales' old state-dict keys, renamed as a state dict saved with them loads
    ("fp4moe_ops/prepared.py", "fc1/fc2"): (
        "State dicts saved when the input scales' buffers were named ``fc1_input_scale``",
        "OLD_INPUT_SCALE_BUFFERS = dict(zip((\"fc1_input_scale\", \"fc2_input_scale\")",
    ),
    # the NVFP4 linear op takes a checkpoint's tensors as they are; FlashInfer's GEMM calls its scale alpha
    ("fp4moe_ops/linear.py", "checkpoint scale names"): ("(the last one is its ``weight_scale_2``)",),
    ("fp4moe_ops/linear.py", ALPHA): ("alpha=global_scale.reshape(1)",),
}


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def allowed(path: str, rule: str, line: str) -> bool:
    return rule in ALLOWED_FILES.get(path, ()) or any(piece in line for piece in ALLOWED_LINES.get((path, rule), ()))


def retired_names(path: Path) -> list[str]:
    """``"file:line: name (rule)"`` for each retired name ``path`` holds outside the allow-lists."""
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for number, line in enumerate(lines, 1):
        for rule, pattern in RETIRED.items():
            for match in pattern.finditer(line):
                if not allowed(rel, rule, line):
                    found.append(f"{rel}:{number}: {match.group(0)} ({rule})")
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NAME and token.string == ALPHA:
            number = token.start[0]
            if not allowed(rel, ALPHA, lines[number - 1]):
                found.append(f"{rel}:{number}: alpha (an identifier: swiglu_alpha or output_scale)")
    return found


def test_the_packages_use_one_name_per_concept():
    found = [hit for path in sources() for hit in retired_names(path)]
    assert not found, "retired names (CONTRIBUTING.md, \"Names\"):\n" + "\n".join(found)


@pytest.mark.parametrize("path,rule,pieces", [(p, r, pieces) for (p, r), pieces in ALLOWED_LINES.items()])
def test_every_allowed_line_is_still_there(path, rule, pieces):
    # a stale entry would allow the name on some other line that happens to hold the text
    text = (ROOT / path).read_text()
    for piece in pieces:
        assert piece in text, f"{path}: no line holds {piece!r} any more; drop it from ALLOWED_LINES"


def test_every_allowed_file_exists_and_uses_what_it_is_allowed():
    for path, rules in ALLOWED_FILES.items():
        text = (ROOT / path).read_text()
        for rule in rules:
            pattern = re.compile(r"\balpha\b") if rule == ALPHA else RETIRED[rule]
            assert pattern.search(text), f"{path} no longer uses {rule}; drop it from ALLOWED_FILES"
