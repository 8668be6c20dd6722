#!/usr/bin/env bash
# One call on a lent GPU machine (docs/benchmarks.md, "On a lent machine"): the wheels `make
# gpu-wheels` put in .whl/ installed beside the image's torch, then bench/gpu.py whole and
# bench/warm.py's real-width part at full depth, each under its own limit so that what ran comes
# back; every result written here is packed into $OUT/results.tar.gz.
#   bench/lent.sh [GPU_SECONDS] [WARM_SECONDS]    (GPU_SECONDS 0: bench/warm.py alone)
set -u
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/lent-out}
mkdir -p "$out"
touch /tmp/lent-began
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
if [ "${1:-420}" != 0 ]; then
    began=$SECONDS
    timeout -k 5 "${1:-420}" python3 bench/gpu.py 2>&1 | tee "$out/gpu.log"
    echo "bench/gpu.py: $((SECONDS - began)) s"
fi
began=$SECONDS
timeout -k 5 "${2:-140}" python3 bench/warm.py --runs 0 --wide-layers 0 --wide-device cuda \
    --wide-holds host,device --profile --out bench/results/warm-gpu.json 2>&1 | tee "$out/warm.log"
echo "bench/warm.py: $((SECONDS - began)) s"
find bench/results -newer /tmp/lent-began -type f -print0 | tar -czf "$out/results.tar.gz" --null -T -
tar -tzf "$out/results.tar.gz"
