#!/usr/bin/env bash
# The GPU checks, as one script for a machine with an NVIDIA GPU, cupy and PyTorch CUDA:
# versions, tests/test_gpu.py, bench/ops.py --gpu --tiles, bench/gpu_conv_phases.py and one
# app trained on the GPU.
# Each step has its own time limit and writes its log to $OUT (default: gpu_check/), so a
# step that fails or runs long leaves the others' figures. Where the machine lacks mpi4py
# with an mpiexec, wheels of mpich and mpi4py in .whl/ are installed under /tmp/site first.
# Usage: bash bench/gpu_check.sh [seconds for the tests] [seconds for the benchmark]
# (GPU_CHECK_TESTS=EXPR runs only the tests pytest -k EXPR selects)
set -u
OUT=${OUT:-gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    # a prefix install keeps the wheels' layout: mpich's mpiexec in bin, its libmpi in lib
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/site .whl/*.whl \
        && export PATH=/tmp/site/bin:$PATH \
            PYTHONPATH=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '/tmp/site'}))")
    # mpi4py's wheel loads the first libmpi it finds, which may be the machine's own Open MPI
    [ -e /tmp/site/lib/libmpi.so.12 ] && export MPI4PY_LIBMPI=/tmp/site/lib/libmpi.so.12
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
step() {  # step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0))s"
    tail -n 25 "$OUT/$name.txt"
}
nvidia-smi -L
python3 -c "import sys, numpy, numba, cupy, torch, mpi4py; print(sys.version.split()[0], 'numpy', numpy.__version__,
'numba', numba.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__, 'mpi4py', mpi4py.__version__,
'gpus', cupy.cuda.runtime.getDeviceCount())"
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
step tests "${1:-200}" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider $per_test tests/test_gpu.py \
    ${GPU_CHECK_TESTS:+-k "$GPU_CHECK_TESTS"}
step ops_gpu "${2:-90}" python3 bench/ops.py --gpu --tiles --rounds 1
step conv_phases 40 python3 bench/gpu_conv_phases.py
step alexnet_gpu 60 python3 -m apps.alexnet --gpus-per-rank 1 --cpus-per-rank 1 --iterations 6
