#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA device (run from the repository root, in the
# project's venv): the `gpu`-marked tests (pytest -m gpu), then the one-device MFU benchmark
# (benchmarks/gpu_mfu.py), each under a timeout. Writes into OUT_DIR: nvidia-smi.txt, pytest.txt,
# pytest.xml, gpu_mfu.txt, gpu_mfu.json and REPORT.md (a short summary, also printed).
#
#   bash benchmarks/gpu_check.sh                        # OUT_DIR = gpu_check/<date-time>
#   bash benchmarks/gpu_check.sh out/h100 --ac selective_op   # arguments after OUT_DIR go to gpu_mfu.py
#
# Timeouts (seconds): GPU_CHECK_TEST_TIMEOUT (default 1800), GPU_CHECK_BENCH_TIMEOUT (default 1200).
# Exit status: 0 when both passed, 1 when either failed or timed out, 2 without a CUDA device.
set -u -o pipefail

out=${1:-gpu_check/$(date +%Y%m%d-%H%M%S)}
shift || true
test_timeout=${GPU_CHECK_TEST_TIMEOUT:-1800}
bench_timeout=${GPU_CHECK_BENCH_TIMEOUT:-1200}
mkdir -p "$out"

if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; nothing to check" >&2
    exit 2
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true

echo "gpu_check: pytest -m gpu (timeout ${test_timeout} s) -> $out/pytest.txt"
timeout "$test_timeout" python -m pytest -m gpu -q -rA -p no:cacheprovider tests \
    --junitxml="$out/pytest.xml" >"$out/pytest.txt" 2>&1
tests_rc=$?

echo "gpu_check: benchmarks/gpu_mfu.py (timeout ${bench_timeout} s) -> $out/gpu_mfu.txt"
timeout "$bench_timeout" python benchmarks/gpu_mfu.py --json "$out/gpu_mfu.json" "$@" >"$out/gpu_mfu.txt" 2>&1
bench_rc=$?

verdict() {  # exit status -> word (124: killed by timeout)
    case $1 in 0) echo passed ;; 124) echo "TIMED OUT" ;; *) echo "FAILED (exit $1)" ;; esac
}
{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "device: $(python -c 'import torch; print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count())')"
    echo "torch: $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo "## pytest -m gpu: $(verdict $tests_rc)"
    echo
    echo '```'
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " "$out/pytest.txt" || true
    tail -n 1 "$out/pytest.txt"
    echo '```'
    echo
    echo "## benchmarks/gpu_mfu.py: $(verdict $bench_rc)"
    echo
    echo '```'
    # The header lines and the table (everything from the "trainer" row on), without Lightning's chatter.
    grep -E "^(device|shape|run|peak) +:" "$out/gpu_mfu.txt" || true
    sed -n '/^trainer /,$p' "$out/gpu_mfu.txt"
    [ "$bench_rc" -eq 0 ] || tail -n 20 "$out/gpu_mfu.txt"
    echo '```'
} >"$out/REPORT.md"
cat "$out/REPORT.md"

[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
