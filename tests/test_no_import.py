"""fp4moe with no import: the start-up hook (``fp4moe-autoload.pth`` -> :mod:`fp4moe_autoload`) makes
programs that never import fp4moe load NVFP4 checkpoints through it. Each test runs a fresh
interpreter in a subprocess, as a user's program or Transformers' CLI would start.

Two ways the hook is present: the tests of the mechanism run the ``.pth`` file's own line at the top of
``python -c`` (any environment); the tests of the installation (plain ``python -c`` with nothing
added, ``transformers serve``) need fp4moe installed in this interpreter (``pip install -e .``, as CI
does) and are skipped, saying so, otherwise."""

import importlib.util
import json
import os
import shutil
import site
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PTH = REPO / "fp4moe-autoload.pth"
FIXTURES = Path(__file__).parent / "fixtures"
COMPRESSED_TENSORS = FIXTURES / "llmcompressor" / "qwen3_moe_nvfp4"  # llm-compressor's own export
MODELOPT = FIXTURES / "modelopt" / "qwen3_moe_nvfp4_default"            # ModelOpt's own export
PROMPT_IDS = list(range(3, 12))


def installed_pth() -> Path | None:
    """The hook's ``.pth`` in this interpreter's site-packages (None: fp4moe not installed here)."""
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    found = [Path(d) / PTH.name for d in dirs if (Path(d) / PTH.name).exists()]
    return found[0] if found else None


needs_install = pytest.mark.skipif(installed_pth() is None, reason=(
    "fp4moe is not installed in this interpreter (no fp4moe-autoload.pth in site-packages): pip install -e ."))


def run_python(code: str, cwd: Path, hook: bool, check: bool = True, **env) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh interpreter; ``hook``: the ``.pth`` file's line first, as site.py
    runs it at start-up. ``FP4MOE_AUTOLOAD`` only as given; ``check``: it must succeed."""
    environ = {k: v for k, v in os.environ.items() if k != "FP4MOE_AUTOLOAD"} | {"HF_HUB_OFFLINE": "1"} | env
    source = (PTH.read_text() + "\n" + code) if hook else code
    done = subprocess.run([sys.executable, "-c", source], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 or not check, f"subprocess failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done


LOAD = """
import json, sys, torch
import transformers.quantizers.auto as registry
from transformers import AutoModelForCausalLM
before = "hf_integration" in sys.modules
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.bfloat16)
with torch.no_grad():
    torch.save(model(torch.tensor([{ids!r}])).logits, {out!r})
print(json.dumps({{"imported_before_load": before, "imported_after_load": "hf_integration" in sys.modules,
                  "nvfp4_experts": sum(type(m).__name__ == "NVFP4Experts" for m in model.modules())}}))
"""


def load_in_subprocess(path: Path, tmp_path: Path, hook: bool, cwd: Path) -> tuple[dict, torch.Tensor]:
    out = tmp_path / "logits.pt"
    done = run_python(LOAD.format(path=str(path), ids=PROMPT_IDS, out=str(out)), cwd=cwd, hook=hook)
    return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out)


def logits_with_import(path: Path) -> torch.Tensor:
    """The same load in this process, where ``hf_integration`` is imported explicitly."""
    import hf_integration  # noqa: F401
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        return model(torch.tensor([PROMPT_IDS])).logits


@pytest.fixture(scope="module")
def fp4moe_save(tmp_path_factory):
    """A Qwen3-MoE that fp4moe patched and saved (a ModelOpt checkpoint), with a tokenizer."""
    from hf_integration import patch_moe
    from hf_integration.tiny_models import tiny_qwen3_moe, tiny_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("fp4moe_save")
    patch_moe(tiny_qwen3_moe(), verbose=False).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_start_up_imports_neither_torch_nor_transformers(tmp_path):
    done = run_python("import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('torch', 'transformers', 'hf_integration', 'fp4moe_ops')))", cwd=REPO, hook=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("checkpoint", ["fp4moe_save", "modelopt_export", "compressed_tensors_export"])
def test_from_pretrained_with_no_import_loads_nvfp4_through_fp4moe(checkpoint, fp4moe_save, tmp_path):
    path = {"fp4moe_save": fp4moe_save, "modelopt_export": MODELOPT, "compressed_tensors_export": COMPRESSED_TENSORS}[
        checkpoint]
    report, logits = load_in_subprocess(path, tmp_path, hook=True, cwd=REPO)
    # fp4moe is imported only once Transformers reads the NVFP4 config, then loads every MoE layer
    assert report == {"imported_before_load": False, "imported_after_load": True, "nvfp4_experts": 2}
    assert torch.equal(logits, logits_with_import(path))


@pytest.mark.skipif(not __import__("hf_integration.mxfp4_quantizer").mxfp4_quantizer.supported(),
                    reason="Transformers' gpt-oss before 5.24: its own quantizer loads it")
def test_from_pretrained_with_no_import_keeps_gpt_oss_mxfp4_experts_4_bit(tmp_path):
    # gpt-oss's "mxfp4" config entry has a stand-in too: its experts load as fp4moe's MXFP4 module
    # (bytes as in the files), and the logits equal a load with an explicit import
    from hf_integration.tiny_models import write_gpt_oss_mxfp4_checkpoint

    path = tmp_path / "gpt_oss"
    write_gpt_oss_mxfp4_checkpoint(path, seed=1)
    out = tmp_path / "logits.pt"
    code = LOAD.format(path=str(path), ids=PROMPT_IDS, out=str(out)).replace(
        '"NVFP4Experts"', '"MXFP4GptOssExperts"')
    done = run_python(code, cwd=REPO, hook=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"imported_before_load": False, "imported_after_load": True, "nvfp4_experts": 2}
    torch.testing.assert_close(torch.load(out), logits_with_import(path), rtol=0, atol=0)


def test_from_pretrained_with_no_import_keeps_llmcompressor_mxfp4_experts_4_bit(tmp_path):
    # an MXFP4 compressed-tensors config comes through the same stand-in as an NVFP4 one
    path = FIXTURES / "llmcompressor" / "qwen3_moe_mxfp4a16"
    out = tmp_path / "logits.pt"
    code = LOAD.format(path=str(path), ids=PROMPT_IDS, out=str(out)).replace('"NVFP4Experts"', '"MXFP4Experts"')
    report = json.loads(run_python(code, cwd=REPO, hook=True).stdout.strip().splitlines()[-1])
    assert report == {"imported_before_load": False, "imported_after_load": True, "nvfp4_experts": 2}
    torch.testing.assert_close(torch.load(out), logits_with_import(path), rtol=0, atol=0)


def test_a_checkpoint_fp4moe_does_not_read_never_imports_it(tmp_path):
    from hf_integration.tiny_models import tiny_qwen3_moe

    tiny_qwen3_moe().save_pretrained(tmp_path / "bf16")
    report, _ = load_in_subprocess(tmp_path / "bf16", tmp_path, hook=True, cwd=REPO)
    assert report == {"imported_before_load": False, "imported_after_load": False, "nvfp4_experts": 0}


@pytest.mark.parametrize("explicit_import", [True, False])
def test_registry_holds_transformers_entries_under_fp4moes_once_active(explicit_import, fp4moe_save):
    # fp4moe's compressed-tensors entry hands non-NVFP4 configs to Transformers' own class: that must
    # be Transformers' class, not the start-up hook's stand-in (which would hand them back: a loop),
    # whether fp4moe was activated by the hook or imported explicitly
    activate = ("import hf_integration" if explicit_import else
                f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(fp4moe_save)!r})")
    done = run_python(activate + "\nfrom transformers.quantizers import auto\n"
                      "m = auto.AUTO_QUANTIZATION_CONFIG_MAPPING\n"
                      "print(m['compressed-tensors'].transformers_config.__name__, m['modelopt'].__name__)", cwd=REPO,
                      hook=True)
    assert done.stdout.split()[-2:] == ["CompressedTensorsConfig", "ModelOptConfig"]


def test_fp4moe_autoload_0_turns_the_hook_off(fp4moe_save):
    show = ("import transformers.quantizers.auto as r; "
            "print(r.AUTO_QUANTIZATION_CONFIG_MAPPING.get('modelopt'), r.AUTO_QUANTIZATION_CONFIG_MAPPING['compressed-tensors'])")
    on = run_python(show, cwd=REPO, hook=True).stdout
    off = run_python(show, cwd=REPO, hook=True, FP4MOE_AUTOLOAD="0").stdout
    assert "fp4moe" in on and off.split()[0] == "None" and "fp4moe" not in off
    # off, Transformers reads the checkpoint as it would without fp4moe: its quantization unknown
    done = run_python(f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(fp4moe_save)!r})",
                      cwd=REPO, hook=True, check=False, FP4MOE_AUTOLOAD="0")
    assert done.returncode != 0 and "Unknown quantization type, got modelopt" in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                    reason="building fp4moe's wheel offline needs setuptools>=77 here: pip install 'setuptools>=77'")
def test_wheel_installs_the_hook_at_the_root_of_site_packages(tmp_path):
    # pip builds the wheel as it would for `pip install .`, from a copy (the build writes build/ and
    # *.egg-info next to setup.py)
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "__pycache__", "build", "*.egg-info", "tests",
                                                                  "benchmarks"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("fp4moe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read(PTH.name) == PTH.read_bytes()
        assert "fp4moe_autoload.py" in z.namelist()


@needs_install
def test_installed_hook_is_this_checkouts():
    assert installed_pth().read_bytes() == PTH.read_bytes()
    done = run_python("import fp4moe_autoload; print(fp4moe_autoload.__file__)", cwd=Path("/"), hook=False)
    assert Path(done.stdout.strip()).read_bytes() == (REPO / "fp4moe_autoload.py").read_bytes()


@needs_install
def test_plain_python_c_loads_nvfp4_with_no_import(fp4moe_save, tmp_path):
    # nothing added to the program: the installed .pth runs at start-up
    report, logits = load_in_subprocess(fp4moe_save, tmp_path, hook=False, cwd=tmp_path)
    assert report == {"imported_before_load": False, "imported_after_load": True, "nvfp4_experts": 2}
    assert torch.equal(logits, logits_with_import(fp4moe_save))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@needs_install
@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None,
                    reason="transformers serve needs its serving extras: pip install 'transformers[serving]'")
@pytest.mark.parametrize("batching", ["--no-continuous-batching", "--continuous-batching"])
def test_transformers_serve_answers_a_completion_with_no_import(batching, fp4moe_save, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli = Path(sys.executable).parent / "transformers"
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    env = {k: v for k, v in os.environ.items() if k != "FP4MOE_AUTOLOAD"} | {"HF_HUB_OFFLINE": "1"}
    # the paged cache sized for one short request: left unset, Transformers sizes it from free memory,
    # on the CPU 0.8-0.9 of the free RAM
    cache = ["--cb-num-blocks", "2", "--cb-max-batch-tokens", "256"] if batching == "--continuous-batching" else []
    server = subprocess.Popen([str(cli), "serve", str(fp4moe_save), "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu", batching, *cache], cwd=tmp_path, env=env, stdout=log,
                              stderr=subprocess.STDOUT, preexec_fn=os.setsid)  # its own process group
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"transformers serve exited:\n{(tmp_path / 'serve.log').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "transformers serve did not come up within 180 s"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        answer = _post(f"http://127.0.0.1:{port}/v1/completions",
                       {"model": str(fp4moe_save), "prompt": "w1 w2 w3", "max_tokens": 5}, timeout=180)
    finally:
        server.terminate()  # by its PID
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    served = (tmp_path / "serve.log").read_text()
    assert "Unknown quantization type" not in served, served[-4000:]
    # the served text is greedy generate of the same checkpoint, loaded here with fp4moe imported
    import hf_integration  # noqa: F401

    tok = AutoTokenizer.from_pretrained(fp4moe_save)
    model = AutoModelForCausalLM.from_pretrained(fp4moe_save)
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    new = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert answer["choices"][0]["text"].split() == tok.decode(new, skip_special_tokens=True).split(), answer


@needs_install
@pytest.mark.skipif(shutil.which("lm_eval", path=str(Path(sys.executable).parent)) is None,
                    reason="lm-evaluation-harness is not installed: pip install lm-eval")
def test_lm_eval_cli_scores_a_checkpoint_through_fp4moe_with_no_import(fp4moe_save, tmp_path):
    # lm_eval's own CLI and HF wrapper (`--model hf --model_args pretrained=PATH`), on a local
    # multiple-choice task; its per-choice log-likelihoods are those of the checkpoint loaded here
    # with fp4moe imported, scored by the same harness in this process
    sys.path.insert(0, str(REPO / "tools"))
    from lm_eval_tiny import evaluate, write_task

    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_task(tmp_path, n=6)
    env = {k: v for k, v in os.environ.items() if k != "FP4MOE_AUTOLOAD"} | {"HF_HUB_OFFLINE": "1",
                                                                              "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([str(Path(sys.executable).parent / "lm_eval"), "--model", "hf", "--model_args",
                           f"pretrained={fp4moe_save},dtype=bfloat16,max_length=128", "--tasks", "fp4moe_tiny",
                           "--include_path", str(tmp_path), "--device", "cpu", "--batch_size", "8", "--output_path",
                           str(tmp_path / "out"), "--log_samples"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Unknown quantization type" not in done.stderr
    (samples,) = (tmp_path / "out").rglob("samples_fp4moe_tiny_*.jsonl")
    docs = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda d: d["doc_id"])
    served = torch.tensor([float(r[0][0]) for d in docs for r in d["resps"]])
    import hf_integration  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(fp4moe_save, dtype=torch.bfloat16)
    _, here = evaluate(model, AutoTokenizer.from_pretrained(fp4moe_save), tmp_path)
    assert served.shape == here.shape == (24,)
    assert torch.allclose(served, here.float(), rtol=1e-3, atol=1e-3), (served, here)
