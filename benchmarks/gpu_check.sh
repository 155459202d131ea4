#!/usr/bin/env bash
# Issue #24's GPU figures and the CUDA tests, in one call of a lent GPU machine (benchmarks/README.md, "On a GPU").
#
#   benchmarks/gpu_check.sh fetch   # here, where pip reaches its index: the wheels the GPU image lacks, into .whl/
#   benchmarks/gpu_check.sh run     # on the GPU machine, from the repository root, with .whl/ carried along
#   benchmarks/gpu_check.sh variants   # there too: the layer with 1, 2 and 4 server workers and pinned copies, the
#                                      # server path's ceiling (bench_throughput --preset transport), the CUDA tests
#   benchmarks/gpu_check.sh bytes      # there too: the layer, the ceiling and throughput with float16 on the wire
#   benchmarks/gpu_check.sh shared     # there too: the layer and the ceiling with the payload through shared memory
#                                      # (the default) and through gRPC, then throughput, the CUDA tests, bf16
#   benchmarks/gpu_check.sh next       # there too (run 2026-11-27): the layer through shared memory, through
#                                      # gRPC and with 4 server processes (dmoe-server --processes), its profile, the
#                                      # CUDA tests, throughput with 1 and with 4 server processes
#   benchmarks/gpu_check.sh after      # there too, the one to run first: the layer with 4 server processes with and
#                                      # without hold calls, its server and client stages, the CUDA tests, the
#                                      # bf16 layer, 8 processes, throughput, the 1-process layer (GPU_BUDGET_S=330
#                                      # fits what it can into a 15-minute lease, skipping the rest)
#   benchmarks/gpu_check.sh graphs     # there too, the one to run next: the CUDA tests, then the layer with and
#                                      # without --cuda-graphs, 1 process with them, its profile, (the code in
#                                      # .before/ if carried), bf16, 8 processes, throughput
#
# The GPU image has Python 3.12 with torch, numpy, tqdm, matplotlib, pytest and prometheus-client, but not the DHT's
# packages (kademlia, rpcudp, u-msgpack-python), cryptography, nor necessarily the grpcio/protobuf versions the
# committed stubs need: `fetch` downloads those (the versions pinned here are the ones .venv uses), `run` installs
# them under /tmp/site. `run` then goes through the checks, most wanted first, each under its own time limit, and
# writes each one's output to $OUT/NAME.txt (default results/gpu; at most 8 files, what the device tool brings back:
# related checks share one) as it goes, so a run cut short keeps what it measured, and prints each one's last lines. It
# starts no new check once GPU_BUDGET_S seconds (default 480) have passed: a lent machine's time is short.
set -u
cd "$(dirname "$0")/.."

WHEELS=(kademlia==2.2.3 rpcudp==5.0.1 u-msgpack-python==2.8.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
        grpcio==1.85.3 protobuf==7.36.2)

fetch() {
    mkdir -p .whl
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    ls -l .whl
}

run() {  # run [PLAN]: the checks of plan_PLAN (default: plan_issue)
    local out=${OUT:-results/gpu} budget=${GPU_BUDGET_S:-480} started=$SECONDS plan=plan_${1:-issue}
    mkdir -p "$out"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed: run 'benchmarks/gpu_check.sh fetch' here first"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    step() {  # step NAME SECONDS COMMAND...: one check, its output appended to $out/NAME.txt (NAME up to a '.')
        local name=$1 limit=$2 file="$out/${1%%.*}.txt"
        shift 2
        if (( SECONDS - started + 20 > budget )); then
            echo "== $name: skipped, the ${budget}s budget is spent" | tee -a "$file"
            return
        fi
        local t0=$SECONDS
        echo "== $name: $*" >> "$file"
        timeout "$limit" "$@" >> "$file" 2>&1
        local rc=$?
        echo "== $name: rc $rc in $((SECONDS - t0))s" | tee -a "$file"
        tail -n 12 "$file"
    }
    nvidia-smi -L
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    echo "$(nproc) CPU cores"
    "$plan"
    echo "done in $((SECONDS - started))s; outputs in $out"
}

plan_issue() {  # issue #24's tables, most wanted first, and the breakdown
    step layer 150 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10
    step throughput 150 python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1.5
    step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step layer_bf16 150 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10 \
        --autocast bf16
    step throughput_bf16 150 python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1.5 \
        --autocast bf16
    step profile.layer 120 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 1 --steps 10 --profile
    step profile.layer_pinned_copies 120 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 1 \
        --steps 10 --profile --overlap-copies
    step profile.throughput 120 python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1 \
        --rounds 1 --profile
    step pinned_copies.layer 120 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10 \
        --overlap-copies
    step pinned_copies.throughput 120 python3 benchmarks/bench_throughput.py --preset compute --device cuda \
        --duration 1.5 --overlap-copies
}

plan_variants() {  # what the server's defaults on a GPU should be, and how far the server's path can go
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10"
    step layer.1_worker 100 $layer
    step layer.2_workers 100 $layer --server-workers 2
    step layer.4_workers 100 $layer --server-workers 4
    step layer.pinned_copies 100 $layer --overlap-copies
    step transport 100 python3 benchmarks/bench_throughput.py --preset transport --device cuda --duration 1 \
        --rounds 1
    step cuda_tests 100 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step layer.4_workers_bf16 100 $layer --server-workers 4 --autocast bf16
    step layer.4_workers_pinned_copies 100 $layer --server-workers 4 --overlap-copies
}

plan_bytes() {  # fewer bytes per row: float16 on the wire (the server still computes in float32, or under autocast)
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10"
    step layer.none 100 $layer
    step layer.float16 100 $layer --compression float16
    step layer.float16_bf16 100 $layer --compression float16 --autocast bf16
    step transport.none 100 python3 benchmarks/bench_throughput.py --preset transport --device cuda --duration 1 \
        --rounds 1
    step transport.float16 100 python3 benchmarks/bench_throughput.py --preset transport --device cuda --duration 1 \
        --rounds 1 --compression float16
    step throughput.float16 150 python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1 \
        --rounds 1 --compression float16
}

plan_shared() {  # the payload through shared memory (the default on one host) against gRPC's transport, then the tables
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10"
    local transport="python3 benchmarks/bench_throughput.py --preset transport --device cuda --duration 1 --rounds 1"
    step layer.shared 100 $layer
    step layer.grpc 100 $layer --no-shared-memory
    step transport.shared 100 $transport
    step transport.grpc 100 $transport --no-shared-memory
    step throughput 120 python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1 --rounds 1
    step cuda_tests 100 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step layer_bf16.shared 100 $layer --autocast bf16
    step layer_bf16.float16_wire 100 $layer --autocast bf16 --compression float16
}

plan_next() {  # what the GPU has not measured yet, most wanted first: shared memory, then several server processes
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10"
    local throughput="python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 1 --rounds 1"
    step layer.shared 60 $layer
    step layer.grpc 60 $layer --no-shared-memory
    step layer.4_processes 60 $layer --server-processes 4
    step profile.layer 60 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 1 --steps 10 --profile
    step cuda_tests 80 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step throughput.1_process 110 $throughput
    # the processes share the server's --activation-cache-mb: 2048 leaves each the 512 one process has by default;
    # 4 clients of one request each, one per expert, so that the clients' Python is not the bound
    step throughput.4_processes 110 $throughput --server-processes 4 --activation-cache-mb 2048 --clients 4 \
        --inflight 1
}

plan_after() {  # run 2 of 2026-11-27, since then also without the client's hold calls (to compare) and in this
               # order: the layer with 4 server processes, where its step goes (server and client stages), the
               # CUDA tests, the bf16 layer, 8 processes, throughput (fp32, then bf16), the 1-process layer
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 2 --steps 10"
    local throughput="python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 0.6 --rounds 1 \
--server-processes 4 --activation-cache-mb 2048 --clients 4 --inflight 1"
    step layer.4_processes 60 $layer --server-processes 4
    step layer.4_processes_no_hold 60 $layer --server-processes 4 --no-hold-calls
    step profile.layer_4_processes 60 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 1 \
        --steps 10 --server-processes 4 --profile --client-profile
    step cuda_tests 80 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step layer_bf16.4_processes 60 $layer --server-processes 4 --autocast bf16
    step layer.8_processes 60 $layer --server-processes 8
    step throughput.4_processes 100 $throughput
    step throughput_bf16.4_processes 100 $throughput --autocast bf16
    step layer.1_process 60 $layer
}

plan_graphs() {  # run 4 of 2026-11-27 (then 2 rounds, another order): the experts on CUDA graphs (dmoe-server
                # --cuda-graphs) against without, after the CUDA tests that check them against the eager expert; with
                # .before/ (a copy of the code before, `git archive REV dmoe benchmarks | tar -x -C .before`, carried)
                # the layer with that code too. 3 rounds, so that a median is one round's (review 51); the one-process
                # layer early: with training steps as graphs, does one process still need company?
    local layer="python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 3 --steps 10 --warmup 6"
    local throughput="python3 benchmarks/bench_throughput.py --preset compute --device cuda --duration 0.6 --rounds 1 \
--server-processes 4 --activation-cache-mb 2048 --clients 4 --inflight 1"
    step cuda_tests 100 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py
    step layer.4_processes_graphs 80 $layer --server-processes 4 --cuda-graphs
    step layer.4_processes 80 $layer --server-processes 4
    step layer.1_process_graphs 80 $layer --cuda-graphs
    step profile.layer_4_processes_graphs 60 python3 benchmarks/bench_layer.py --device cuda --threads 4 --rounds 1 \
        --steps 10 --warmup 6 --server-processes 4 --cuda-graphs --profile --client-profile
    if [[ -d .before ]]; then
        step layer.4_processes_before 80 env PYTHONPATH="/tmp/site:$PWD/.before" python3 .before/benchmarks/bench_layer.py \
            --device cuda --threads 4 --rounds 3 --steps 10 --warmup 6 --server-processes 4
    fi
    step layer_bf16.4_processes_graphs 90 $layer --server-processes 4 --autocast bf16 --cuda-graphs
    step layer.8_processes_graphs 80 $layer --server-processes 8 --cuda-graphs
    step throughput.4_processes_graphs 100 $throughput --cuda-graphs
}

case "${1:-}" in
    fetch) fetch ;;
    run) run issue ;;
    variants) run variants ;;
    bytes) run bytes ;;
    shared) run shared ;;
    next) run next ;;
    after) run after ;;
    graphs) run graphs ;;
    *) echo "usage: $0 fetch|run|variants|bytes|shared|next|after|graphs" >&2; exit 2 ;;
esac
