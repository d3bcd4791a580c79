#!/usr/bin/env bash
# On a lent GPU machine, in the copy of the tree the device tool makes, with .whl/ from
# bench/gpu-carry.sh and .before-tree/ from `make gpu-report DRY=1` carried:
#   STAGE=1 bash bench/gpu-device.sh   call 1: keeps the model's first part in /tmp/carry
#   bash bench/gpu-device.sh           call 2: installs the wheels and the model into
#                                      /tmp/site, then runs `gpu-report.sh` with QUICK=1
#                                      into $OUT (or gpu-report/)
#   bash bench/gpu-device.sh CMD...    call 2 running CMD instead of the report, e.g.
#                                      python3 -m bench sampler --device cuda --parts phases
# The device's own Python, torch and transformers are used.
set -u
PYTHON=${PYTHON:-python3}
if [ "${STAGE:-}" = 1 ]; then
    mkdir -p /tmp/carry && cp .whl/a/model.part-* /tmp/carry/ && ls -la /tmp/carry
    exit
fi
name=$(cat .whl/b/model.name)
cat /tmp/carry/model.part-* .whl/b/model.part-* > "/tmp/$name"
(cd /tmp && sha256sum -c - < "$OLDPWD/.whl/b/model.sha256") || exit 2
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/b/*.whl "/tmp/$name" || exit 2
export PYTHONPATH=/tmp/site:$PWD DJANGO_SECRET_KEY=gpu-report-throwaway HF_HUB_OFFLINE=1
[ $# -gt 0 ] && exec "$@"
PYTHON=$PYTHON GPU_REPORT_DIR=${OUT:-gpu-report} QUICK=1 bash bench/gpu-report.sh
