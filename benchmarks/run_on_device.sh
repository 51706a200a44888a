#!/bin/bash
# One run on a CUDA machine, from the repository root with fp4moe installed: GPU tests, benchmarks,
# probes. Logs and results go to $OUT (default benchmarks/out). CONTRIBUTING.md lists the steps.
#   bash benchmarks/run_on_device.sh STEP...  (smoke tests bench sweep profile demo accuracy modelopt e2e model serve
#   route firstpass firstpass_noahead probecompile probev3 probestream linear patchmem profile_decode decoder_layer pipeline ncu gluonprefill
#   densebound w4a8 backward gptoss gptoss_tests generate_batch generate_loop prefill_routing ophost batchdecode)
set -o pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/gpu.txt"
for step in "$@"; do
  case $step in
    smoke) python3 .device/smoke.py 2>&1 | tee "$OUT/smoke.log" ;;
    tests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider ${TESTS:-tests/test_gpu.py tests/test_triton_backend.py} 2>&1 | tee "$OUT/tests.log" | grep -E "rel err|passed|failed|Error|error" ;;
    bench) timeout 400 python3 benchmarks/bench_moe.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" ;;
    sweep) timeout 300 python3 benchmarks/probes/sweep_triton.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" ;;
    gluonprefill) timeout 300 python3 benchmarks/probes/probe_gluon_prefill.py ${GLUON_PREFILL_ARGS:-} 2>&1 | tee "$OUT/gluon_prefill.log" ;;
    pipeline) timeout 300 python3 benchmarks/probes/sweep_pipeline.py --out "$OUT" ${PIPELINE_ARGS:-} 2>&1 | tee "$OUT/sweep_pipeline.log" ;;
    ncu) timeout 200 ncu --clock-control none --kernel-name "regex:_gate_up_|_down_|_prefill_gemm" --launch-skip 2 --launch-count 2 \
           --section SpeedOfLight --section WarpStateStats --section Occupancy \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
           python3 benchmarks/probes/ncu_layer.py ${NCU_ARGS:---tokens 1024} > "$OUT/ncu.txt" 2>&1; tail -5 "$OUT/ncu.txt" ;;
    backward) timeout 200 python3 benchmarks/bench_backward.py ${BACKWARD_ARGS:-} 2>&1 | tee "$OUT/backward.log" ;;
    profile) timeout 120 python3 benchmarks/probes/profile_layer.py ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" ;;
    demo) timeout 120 python3 -m hf_integration.demo 2>&1 | tee "$OUT/demo.log" | grep -v -i warn ;;
    accuracy) timeout 240 python3 benchmarks/accuracy_study.py 2>&1 | tee "$OUT/accuracy.log" | grep -v -i warn ;;
    modelopt) timeout ${MODELOPT_TIMEOUT:-420} python3 benchmarks/bench_modelopt_gpu.py --out "$OUT" ${MODELOPT_ARGS:-} 2>&1 | tee "$OUT/modelopt.log" | grep -v -i warn ;;
    e2e) timeout ${E2E_TIMEOUT:-330} python3 benchmarks/bench_e2e.py --out "$OUT" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | grep -v -i warn ;;
    model) timeout ${MODEL_TIMEOUT:-580} python3 benchmarks/bench_model.py --out "$OUT" ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model.log" | grep -v -i warn ;;
    # transformers serve's extra and fp4moe's start-up hook, offline: wheels carried in .serve-wheels (CONTRIBUTING.md)
    serve) if [ -d .serve-wheels ]; then
             { python3 -m pip install -q --no-index --find-links .serve-wheels openai fastapi uvicorn starlette rich requests &&
               python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; } 2>&1 | tee "$OUT/serve_install.log"
           else
             echo "no .serve-wheels carried: transformers serve's extra and fp4moe's start-up hook must already be installed"
           fi
           timeout ${SERVE_TIMEOUT:-580} python3 benchmarks/bench_serve.py --out "$OUT" ${SERVE_ARGS:-} 2>&1 | tee "$OUT/serve.log" | grep -v -i warn ;;
    profile_decode) timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/probes/profile_decode_step.py ${PROFILE_DECODE_ARGS:-} 2>&1 | tee "$OUT/profile_decode.log" | grep -v -i warn ;;
    decoder_layer) timeout ${LAYER_TIMEOUT:-400} python3 benchmarks/bench_decoder_layer.py --out "$OUT" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/decoder_layer.log" | grep -v -i "warn\|attention mask" ;;
    generate_loop) timeout ${GENERATE_LOOP_TIMEOUT:-500} python3 benchmarks/probes/probe_generate_loop.py ${GENERATE_LOOP_ARGS:---layers 48 --prefill 4096} 2>&1 | tee "$OUT/generate_loop.log" | grep -v -i warn ;;
    ophost) timeout ${OPHOST_TIMEOUT:-240} python3 benchmarks/probes/probe_op_host.py ${OPHOST_ARGS:---model-layers 1,2} 2>&1 | tee "$OUT/op_host.log" ;;
    batchdecode) timeout ${BATCHDECODE_TIMEOUT:-500} python3 benchmarks/probes/probe_batch_decode.py ${BATCHDECODE_ARGS:---batch 32} 2>&1 | tee "$OUT/batch_decode.log" | grep -v -i warn ;;
    prefill_routing) timeout 120 python3 benchmarks/probes/probe_prefill_routing.py 2>&1 | tee "$OUT/prefill_routing.log" ;;
    route) TRITON_CACHE_DIR=$(mktemp -d) timeout 120 python3 benchmarks/probes/probe_route.py 2>&1 | tee "$OUT/route.log" ;;
    firstpass) timeout 400 python3 benchmarks/bench_first_pass.py --out "$OUT" ${FIRSTPASS_ARGS:-} 2>&1 | tee "$OUT/first_pass.log" | grep "^|" ;;
    # the same without the first-call compile of every variant (launch.COMPILE_AHEAD), rows added to first_pass.*
    firstpass_noahead) FP4MOE_COMPILE_AHEAD=0 timeout 200 python3 benchmarks/bench_first_pass.py --out "$OUT" --impls fp4moe \
           --label "no compile ahead" 2>&1 | tee "$OUT/first_pass_noahead.log" | grep "^|" ;;
    probev3) timeout 300 python3 benchmarks/probes/probe_v3_decode.py ${V3_ARGS:-} 2>&1 | tee "$OUT/probe_v3_decode.log" | grep "ms;" ;;
    probestream) timeout 200 python3 benchmarks/probes/probe_stream.py ${STREAM_ARGS:-} 2>&1 | tee "$OUT/probe_stream.log" ;;
    densebound) timeout 300 python3 benchmarks/probes/probe_dense_bound.py ${DENSE_ARGS:-} 2>&1 | tee "$OUT/probe_dense_bound.log" ;;
    w4a8) timeout ${W4A8_TIMEOUT:-450} python3 benchmarks/probes/probe_w4a8_bound.py --out "$OUT" ${W4A8_ARGS:-} 2>&1 | tee "$OUT/w4a8_bound.log" | grep -v -i warn ;;
    probecompile) timeout 200 python3 benchmarks/probes/probe_compile.py ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe_compile.log" | grep -v -i warn ;;
    gptoss_tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_mxfp4_triton.py tests/test_gpt_oss_nvfp4.py 2>&1 | tee "$OUT/gptoss_tests.log" | tail -5 ;;
    gptoss) timeout ${GPTOSS_TIMEOUT:-500} python3 benchmarks/bench_gpt_oss.py --out "$OUT" ${GPTOSS_ARGS:-} 2>&1 | tee "$OUT/gpt_oss.log" | grep -v -i warn ;;
    generate_batch) timeout 400 python3 benchmarks/bench_generate_batch.py --layers 2 --requests 16,32,64 --out "$OUT" 2>&1 | tee "$OUT/generate_batch.log" | grep -v -i warn ;;
    linear) timeout ${LINEAR_TIMEOUT:-200} python3 benchmarks/bench_linear.py ${LINEAR_ARGS:-} 2>&1 | tee "$OUT/linear.log" ;;
    patchmem) timeout 200 python3 benchmarks/bench_patch_memory.py --device cuda ${PATCHMEM_ARGS:---layers 2 --experts 256 --hidden 7168 --inter 2048} 2>&1 | tee "$OUT/patch_memory.log" | grep -v -i warn ;;
  esac
done
