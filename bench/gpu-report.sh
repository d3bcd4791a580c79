#!/usr/bin/env bash
# The GPU report (`make gpu-report`, or `PYTHON=python3 bash bench/gpu-report.sh` where the
# packages are installed without the virtualenv): on a machine whose torch sees a CUDA device,
#   1. the CUDA graph tests (tests/gpu) and
#   2. the real-model tests (the transformers sampler, the static decoder and the model service
#      with the packaged SmolLM2), on cuda:0 in bf16,
# side by side (both only check results), then
#   3. the model benchmark alone (it times): eager `generate` against the CUDA graphs at batch
#      sizes 1, 10, 50 and 100, with 16 and 32 new tokens.
# Everything lands in $GPU_REPORT_DIR (default gpu-report/): machine.txt, the pytest logs and
# JUnit files, and sampler.md (the benchmark's tables). Exits non-zero if a step failed.
set -u
PYTHON=${PYTHON:-python3}
DIR=${GPU_REPORT_DIR:-gpu-report}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1

"$PYTHON" - <<'PY' > "$DIR/machine.txt" || exit 2
import platform, sys, torch, transformers
if not torch.cuda.is_available():
    sys.exit("gpu-report: torch sees no CUDA device; run it on a GPU machine")
p = torch.cuda.get_device_properties(0)
print(f"GPU: {p.name}, {p.total_memory // 2**20:,} MiB, {p.multi_processor_count} SMs")
print(f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
print(f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
print(f"host: {platform.platform()}")
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >> "$DIR/machine.txt" 2>&1
cat "$DIR/machine.txt"

pytest_run() {  # name, then pytest's arguments
    local name=$1
    shift
    "$PYTHON" -m pytest -p no:cacheprovider -q --durations=5 --junitxml="$DIR/$name.xml" "$@" \
        > "$DIR/$name.log" 2>&1
}
pytest_run gpu tests/gpu --confcutdir tests/gpu &
gpu=$!
pytest_run integration tests/integration/test_hf_sampler.py \
    tests/integration/test_static_decode.py tests/integration/test_model_service.py &
integration=$!
status=0
wait $gpu || status=1
wait $integration || status=1
for name in gpu integration; do echo "== $name: $(tail -n 1 "$DIR/$name.log")"; done

"$PYTHON" -m bench sampler --device cuda --max-new-tokens 16,32 --prompt-tokens 20-200 \
    > "$DIR/sampler.md" 2>&1 || status=1
cat "$DIR/sampler.md"
exit $status
