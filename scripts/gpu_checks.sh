#!/usr/bin/env bash
# gpu_checks.sh: the checks that need a CUDA device, in one run, on a machine that has one and none of
# flashckpt's build dependencies (the device tool's GPU machine), from a device bundle made here:
#
#   ../shared/tools/device-bundle build .devbundle     # then, on the GPU machine, in the repository root:
#   scripts/gpu_checks.sh .devbundle OUTDIR
#
# It runs, each under its own time limit and in this order: the GPU test binary (tests/bin/gpu_test),
# cuda_copy_bench at 4 GiB (the snapshot's D2H rate against a bare cudaMemcpyAsync, the trainer's
# blocking time, a compute kernel with and without a snapshot in flight), the GPU Python tests
# (test_torch_cuda, test_torch_cuda_sigkill: SIGKILL and bit-exact resume on the GPU, the files read
# by the safetensors package), a training loop of about 300 MiB of state on the GPU with and without
# saving (examples/train_mlp.py --device cuda), and bench/peers_bench.py --device cuda (flashckpt,
# DCP's async_save with pinned staging, torch.save). The log goes to stdout and OUTDIR/gpu_checks.log;
# the exit status is the number of sections that failed. GPU_CHECKS="gpu_test peers_bench ..." runs only
# those sections (machine and python-extension always run); GPU_SIGKILL_TESTS names test methods of
# test_torch_cuda_sigkill, GPU_PEERS_ROUNDS the rounds of peers_bench (3) and GPU_PEERS_LIMIT its time limit in
# seconds (240).
set -uo pipefail
bundle=$(cd "${1:-.devbundle}" && pwd)
out=${2:-/tmp/gpu-checks}
mkdir -p "$out"
exec > >(tee "$out/gpu_checks.log") 2>&1

# The bundle's programs find its libraries through wrappers, so that python3 (torch) keeps its own.
wrapped=$bundle/wrapped-bin
mkdir -p "$wrapped"
for p in "$bundle"/bin/*; do
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s/lib exec %s "$@"\n' "$bundle" "$p" >"$wrapped/$(basename "$p")"
  chmod +x "$wrapped/$(basename "$p")"
done
export FLASHCKPT_BIN_DIR=$wrapped FLASHCKPT_PYTHON_DIR=$bundle/python PYTHONPATH=$bundle/python
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONWARNINGS=ignore wrapped

failed=0
section() {  # section NAME SECONDS CMD...
  local name=$1 limit=$2 started=$SECONDS rc
  shift 2
  if [[ -n ${GPU_CHECKS:-} && $name != machine && $name != python-extension && " $GPU_CHECKS " != *" $name "* ]]; then
    return
  fi
  echo "=== $name (limit ${limit} s, $(date +%T))"
  timeout --kill-after=10 "$limit" "$@"
  rc=$?
  echo "=== $name: exit $rc after $((SECONDS - started)) s"
  ((rc == 0)) || failed=$((failed + 1))
}

train_loop() {  # the same GPU training loop saving every 10 steps (EMA every step), then not saving
  local tmp
  tmp=$(mktemp -d /tmp/fc-gpu-train.XXXXXX)
  "$wrapped/flashckptd" --socket "$tmp/s.sock" --root "$tmp/root" --max-host-memory 4GiB >"$tmp/d.log" 2>&1 &
  local daemon=$!
  for _ in $(seq 100); do [[ -S $tmp/s.sock ]] && break; sleep 0.1; done
  local common=(--socket "$tmp/s.sock" --device cuda --hidden 2048 --depth 6 --steps 300 --quiet)
  local failed=0
  echo "--- not saving"
  python3 examples/train_mlp.py "${common[@]}" --job plain --save-every 1000000 --no-ema || failed=$((failed + 1))
  echo "--- saving: a checkpoint every 10 steps (its EMA update with it)"
  python3 examples/train_mlp.py "${common[@]}" --job saving10 --save-every 10 --ema-every 10 || failed=$((failed + 1))
  echo "--- saving: a checkpoint every 10 steps, the EMA every step"
  python3 examples/train_mlp.py "${common[@]}" --job saving --save-every 10 --ema-every 1 || failed=$((failed + 1))
  kill "$daemon"; wait "$daemon"
  rm -rf "$tmp" /dev/shm/flashckpt.saving* /dev/shm/flashckpt.plain.*
  return "$failed"
}
export -f train_loop

# The daemon's slots live in /dev/shm: a 4 GiB state takes two 4 GiB slots and the EMA.
shm_gib=$(($(df --output=size -k /dev/shm | tail -1) / 1048576))
if ((shm_gib < 24)); then
  echo "/dev/shm is ${shm_gib} GiB: remounting it at 48 GiB"
  mount -o remount,size=48G /dev/shm || echo "remount failed: large states will not fit"
fi

section machine 60 sh -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv; nproc; free -g; df -h /dev/shm /tmp; python3 -c "import torch, safetensors; print(\"torch\", torch.__version__, torch.cuda.get_device_name(), \
  \"safetensors\", safetensors.__version__)"'
# The extension finds the bundle's libraries, and they theirs, through its RPATH (a RUNPATH would
# not reach the libraries' own dependencies): python3 runs without LD_LIBRARY_PATH.
sed -i 's/-Wl,-rpath,/-Wl,--disable-new-dtags,-rpath,/' "$bundle/build-python-ext.sh"
section python-extension 120 "$bundle/build-python-ext.sh"
section gpu_test 120 "$bundle/run.sh" "$bundle/tests/bin/gpu_test"
section cuda_copy_bench 150 bash -o pipefail -c '"$wrapped/cuda_copy_bench" --bytes 4GiB --dir /tmp --log-level debug |
  grep -E "^cuda_copy_bench|^  |^SUMMARY|\[client\]"' 
section test_torch_cuda 120 python3 tests/python/test_torch_cuda.py
section test_torch_cuda_sigkill 240 python3 tests/python/test_torch_cuda_sigkill.py ${GPU_SIGKILL_TESTS:-}
section train_loop 150 bash -c train_loop
section peers_bench "${GPU_PEERS_LIMIT:-240}" python3 bench/peers_bench.py --bin-dir "$wrapped" --python-dir "$bundle/python" --device cuda \
  --peers flashckpt,dcp,torch_save --rounds "${GPU_PEERS_ROUNDS:-3}" --dir /tmp
echo "=== $failed section(s) failed"
exit "$failed"
