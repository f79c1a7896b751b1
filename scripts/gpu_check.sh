#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (run from the repository root; about 5-8 minutes):
#  1. the GPU-marked tests (host tier and disk tier token-identical on CUDA, lossless subspec on CUDA);
#  2. the host-tier benchmark on a Qwen2.5-7B-shaped random-weight model with an 8 GiB budget: measured
#     host-to-device bandwidth, t_forward / bound for plain offloaded decoding, and subspec draft-step and
#     verify timings (tau means nothing with random weights).
# Needs python with a CUDA build of torch, transformers, safetensors, hqq, tqdm and pytest (+ scipy).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export SUBSPEC_CACHE=${SUBSPEC_CACHE:-/tmp/subspec-cache}
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
echo "== GPU tests"
timeout 240 python -m pytest -q -m gpu tests -p no:cacheprovider; t=$?
echo "== host-tier benchmark (Qwen2.5-7B shape, random weights, 8 GiB)"
timeout 300 python scripts/gpu_bench.py --budget 8GiB; b=$?
echo "gpu_check: tests exit $t, benchmark exit $b"
exit $(( t != 0 || b != 0 ))
