"""``transformers serve --continuous-batching`` under concurrent load, HF BF16 and fp4moe: the same
Qwen3-MoE model saved as two checkpoints and served by Transformers' own server, one after the
other, each answering N concurrent HTTP requests.

    python benchmarks/bench_serve.py --layers 4 --requests 16,64 [--serve-args "--cb-use-cuda-graph"]
    python benchmarks/bench_serve.py --tiny                # small shapes on the CPU (a smoke test)

The model has Qwen3-30B-A3B's dimensions (``--layers`` of its 48 decoder layers, random weights)
and a word-level tokenizer over the whole vocabulary ("w<id>" per token id), so every generated id
has a text and a served answer's words are its token ids. ``bf16`` is Transformers' model as
built; ``fp4moe`` is the same after ``patch_moe``, saved as a ModelOpt NVFP4 checkpoint, which
the server loads through fp4moe's start-up hook (no import). Per variant:

* the server is started (``--continuous-batching``, plus ``--serve-args``), and stopped after;
* per concurrency N: one warm-up round of N requests, then a timed round: N threads each POST
  ``/v1/completions`` (a prompt of ``--prompt`` random words, ``max_tokens=--new``, no sampling
  parameters: the checkpoint's greedy generation config) at once; tokens/s = the completion tokens
  the server reports over the round's wall time; p50 / p99 = the requests' latencies;
* the first ``--check`` answers of the largest round against ``generate()`` of the same checkpoint
  loaded in this process (greedy, one request at a time): how many are equal token for token.
  Batched bf16 arithmetic can turn a near-tied greedy choice, so an unequal answer is reported with
  the position where it leaves ``generate()``'s.

Writes ``serve.json`` and ``serve.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generate_batch import QWEN3_30B_A3B, TINY, qwen3_moe  # noqa: E402
from hf_integration import patch_moe  # noqa: E402


def word_tokenizer(vocab_size: int):
    """A tokenizer with a word per id ("w0" .. "w<vocab - 1>"; "w0" pads, "w1" is EOS), split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", unk_token="w0", eos_token="w1")


def write_checkpoints(folder: Path, layers: int, dims: dict, device: str, variants: list[str]) -> dict:
    """The model saved once per variant (bf16 first, then patched), each with the tokenizer."""
    torch.manual_seed(0)
    model = qwen3_moe(layers, dims, device)
    with torch.no_grad():  # experts ~ N(0, 1/H), not 0.02: at small shapes they then decide greedy tokens too
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(std=dims["hidden_size"] ** -0.5)
    model.generation_config.eos_token_id = model.config.eos_token_id = 1
    tokenizer = word_tokenizer(dims["vocab_size"])
    paths = {}
    for variant in variants:
        if variant == "fp4moe":
            patch_moe(model, verbose=False)
        paths[variant] = folder / variant
        model.save_pretrained(paths[variant])
        tokenizer.save_pretrained(paths[variant])
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """``transformers serve`` on a free local port, in its own process group, logging to a file."""

    def __init__(self, checkpoint: Path, device: str, extra: list[str], log: Path, timeout: float):
        cli = Path(sys.executable).parent / "transformers"
        self.port, self.log_path, self.checkpoint = _free_port(), log, checkpoint
        env = {k: v for k, v in os.environ.items() if k != "FP4MOE_AUTOLOAD"} | {"HF_HUB_OFFLINE": "1"}
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [str(cli), "serve", str(checkpoint), "--host", "127.0.0.1", "--port", str(self.port), "--device", device,
             "--continuous-batching", *extra], env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"transformers serve did not come up within {timeout:.0f} s:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)

    def complete(self, prompt: str, new_tokens: int, timeout: float) -> tuple[list[int], int, float]:
        """One request: (the answer's token ids, the completion tokens reported, seconds)."""
        t0 = time.perf_counter()
        answer = _post(f"http://127.0.0.1:{self.port}/v1/completions",
                       {"model": str(self.checkpoint), "prompt": prompt, "max_tokens": new_tokens}, timeout)
        seconds = time.perf_counter() - t0
        ids = [int(w[1:]) for w in answer["choices"][0]["text"].split()]
        return ids, answer.get("usage", {}).get("completion_tokens", len(ids)), seconds

    def round(self, prompts: list[str], new_tokens: int, timeout: float) -> dict:
        """All ``prompts`` at once, one thread each."""
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: self.complete(p, new_tokens, timeout), prompts))
        wall = time.perf_counter() - t0
        latencies = sorted(a[2] for a in answers)
        tokens = sum(a[1] for a in answers)
        if any(a[1] == 0 for a in answers):
            raise RuntimeError(f"an empty answer (the server's log: {self.log_path})")
        return {"tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies),
                "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
                "tokens": tokens, "answers": [a[0] for a in answers]}

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def greedy_agreement(checkpoint: Path, prompts: list[str], answers: list[list[int]], new_tokens: int,
                     device: str) -> tuple[int, list[int]]:
    """How many answers equal ``generate()`` of ``checkpoint`` here, and where each unequal one
    first differs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map=device)
    equal, first_difference = 0, []
    with torch.no_grad():
        for prompt, got in zip(prompts, answers):
            ids = tok(prompt, return_tensors="pt").input_ids.to(model.device)
            want = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
            if got == want:
                equal += 1
            else:
                first_difference.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                             min(len(got), len(want))))
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return equal, first_difference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", default="16,64")
    ap.add_argument("--prompt", type=int, default=128, help="prompt words (= tokens) per request")
    ap.add_argument("--new", type=int, default=128, help="max_tokens per request")
    ap.add_argument("--variants", default="bf16,fp4moe")
    ap.add_argument("--check", type=int, default=8, help="answers compared with generate() per variant")
    ap.add_argument("--serve-args", default="", help="more `transformers serve` options, e.g. --cb-use-cuda-graph")
    ap.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "fp4moe-bench-serve", help="where the checkpoints go")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the server to come up, and per request")
    ap.add_argument("--tiny", action="store_true", help="small dimensions on the CPU (a smoke test)")
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --tiny for a CPU smoke test)")
    import transformers

    device = "cpu" if args.tiny else "cuda"
    dims = TINY if args.tiny else QWEN3_30B_A3B
    extra = args.serve_args.split()
    if args.tiny:  # Transformers sizes the paged cache from free RAM on a CPU: gigabytes for the tiny model
        extra += ["--cb-num-blocks", "16", "--cb-max-batch-tokens", "512"]
    requests = [int(n) for n in args.requests.split(",")]
    variants = args.variants.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": "CPU" if args.tiny else torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "layers": args.layers, "shapes": "tiny" if args.tiny else "Qwen3-30B-A3B",
              "versions": f"torch {torch.__version__}, Transformers {transformers.__version__}",
              "serve": " ".join(["--continuous-batching", *extra]), "rows": []}

    paths = write_checkpoints(args.folder, args.layers, dims, device, variants)
    rng = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{i}" for i in torch.randint(2, dims["vocab_size"], (args.prompt,), generator=rng).tolist())
               for _ in range(max(requests))]
    for variant in variants:
        server = Server(paths[variant], device, extra, out / f"serve_{variant}.log", args.timeout)
        try:
            for n in requests:
                server.round(prompts[:n], args.new, args.timeout)  # warm-up: compiles, fills the cache
                row = server.round(prompts[:n], args.new, args.timeout)
                answers = row.pop("answers")
                result["rows"].append({"variant": variant, "requests": n, **row})
                print(f"{variant:7s} {n:3d} requests: {row['tokens_per_s']:8.1f} tokens/s, p50 {row['p50_s']:.2f} s, "
                      f"p99 {row['p99_s']:.2f} s", flush=True)
        finally:
            server.stop()
        k = min(args.check, len(answers))
        equal, differ_at = greedy_agreement(paths[variant], prompts[:k], answers[:k], args.new, device)
        result["rows"][-1] |= {"checked": k, "equal_to_generate": equal, "first_difference": differ_at,
                               "checked_answers": answers[:k]}
        print(f"{variant:7s} answers equal to generate(): {equal} of {k} (others differ from token {differ_at})")
        (out / "serve.json").write_text(json.dumps(result, indent=1))

    lines = [f"{result['device']}, {result['date']}: {result['shapes']} shapes, {args.layers} layers, random weights; "
             f"{result['versions']}; `transformers serve {result['serve']}`", "",
             "| variant | requests | tokens/s | p50 latency (s) | p99 latency (s) | equal to `generate()` |",
             "|---|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        check = f"{r['equal_to_generate']} of {r['checked']}" if "checked" in r else ""
        lines.append(f"| {r['variant']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} | "
                     f"{r['p99_s']:.2f} | {check} |")
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print((out / "serve.md").read_text())


if __name__ == "__main__":
    main()
