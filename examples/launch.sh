#!/usr/bin/env bash
# Start N local processes of a jax program, one per GPU, for jax.distributed.initialize().
#
#   examples/launch.sh N script.py [args...]
#
# Process i gets
#   LAUNCH_COORDINATOR_ADDRESS=127.0.0.1:<free port>  (process 0 hosts the coordinator)
#   LAUNCH_NUM_PROCESSES=N  LAUNCH_PROCESS_ID=i  LAUNCH_LOCAL_RANK=i  (its GPU: local_device_ids=[i])
# and runs under `timeout -k 5 $LAUNCH_TIMEOUT` (seconds, default 1800). Output lines are prefixed
# with "[rank i] ". When one process fails, the others get $LAUNCH_GRACE seconds (default 10) to
# finish, then are stopped: a crashed peer would leave them waiting in a collective. Every child is
# stopped when this script exits, however it exits. The exit status is the first failure's (124:
# a timeout), else 0.
#
# Other knobs: PYTHON (interpreter, default python3), LAUNCH_PORT (coordinator port).

set -uo pipefail

usage() {
    echo "usage: $0 NUM_PROCESSES SCRIPT.py [ARGS...]" >&2
    exit 2
}

[[ $# -ge 2 ]] || usage
nprocs=$1
shift
[[ $nprocs =~ ^[1-9][0-9]*$ ]] || usage

python=${PYTHON:-python3}
timeout_s=${LAUNCH_TIMEOUT:-1800}
grace_s=${LAUNCH_GRACE:-10}
port=${LAUNCH_PORT:-$("$python" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

pids=()

stop_all() {
    local pid
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null  # timeout(1) passes it on, and KILLs 5 s later
    done
}

cleanup() {
    trap - EXIT INT TERM
    stop_all
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for ((rank = 0; rank < nprocs; rank++)); do
    LAUNCH_COORDINATOR_ADDRESS="127.0.0.1:$port" \
    LAUNCH_NUM_PROCESSES="$nprocs" \
    LAUNCH_PROCESS_ID="$rank" \
    LAUNCH_LOCAL_RANK="$rank" \
    PYTHONUNBUFFERED=1 \
        timeout -k 5 "$timeout_s" "$python" "$@" \
        > >(sed -u "s/^/[rank $rank] /") 2> >(sed -u "s/^/[rank $rank] /" >&2) &
    pids+=($!)
done

status=0
killer=""
while ((${#pids[@]} > 0)); do
    finished=""
    wait -n -p finished "${pids[@]}"
    rc=$?
    [[ -n $finished ]] || continue  # interrupted by a signal
    for i in "${!pids[@]}"; do
        [[ ${pids[$i]} == "$finished" ]] && unset "pids[$i]"
    done
    if ((rc != 0 && status == 0)); then
        status=$rc
        echo "launch.sh: a process (pid $finished) exited with status $rc" >&2
        if ((${#pids[@]} > 0)); then  # the others may be stuck in a collective with it
            (
                sleep "$grace_s"
                echo "launch.sh: stopping the remaining processes ${grace_s}s after the failure" >&2
                kill -TERM "${pids[@]}" 2>/dev/null
            ) &
            killer=$!
        fi
    fi
done
[[ -z $killer ]] || kill "$killer" 2>/dev/null
exit "$status"
