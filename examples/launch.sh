#!/usr/bin/env bash
# Start N local processes of a jax program, one per GPU, for jax.distributed.initialize().
#
#   examples/launch.sh N script.py [args...]      (or: N -m package.module [args...], N -c code [args...])
#
# Process i gets
#   LAUNCH_COORDINATOR_ADDRESS=127.0.0.1:<free port>  (process 0 hosts the coordinator)
#   LAUNCH_NUM_PROCESSES=N  LAUNCH_PROCESS_ID=i  LAUNCH_LOCAL_RANK=i  (its GPU: local_device_ids=[i])
# and runs under `timeout -k $LAUNCH_KILL_AFTER $LAUNCH_TIMEOUT` (seconds, default 5 and 1800).
# Output lines are prefixed with "[rank i] ". When one process fails, the others get $LAUNCH_GRACE
# seconds (default 10) to finish, then get SIGTERM, and SIGKILL $LAUNCH_KILL_AFTER seconds later
# (after jax.distributed.initialize, jax's preemption notifier catches SIGTERM): a crashed peer
# would leave them waiting in a collective. Every child is stopped when this script exits, however
# it exits. The exit status is the first failure's (124: a timeout), else 0.
#
# A process "fails" when it exits non-zero, and a Python process that raises or calls sys.exit(N)
# after jax.distributed.initialize() does not exit: its atexit jax.distributed.shutdown() waits (up
# to 300 s) for the other processes. So each script runs through examples/failfast.py, which ends a
# failed program with os._exit(status) instead (LAUNCH_FAIL_FAST=0: run it as `python script.py`).
#
# Other knobs: PYTHON (interpreter and its options, default python3), LAUNCH_PORT (coordinator
# port). LAUNCH_TIMEOUT, LAUNCH_GRACE and LAUNCH_KILL_AFTER must be seconds. Needs bash >= 5.1.

set -uo pipefail

# `wait -n -p` (below) needs bash 5.1; an older bash refuses -p and the wait loop would spin.
if ((BASH_VERSINFO[0] < 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] < 1))); then
    echo "$0: needs bash >= 5.1 (for wait -n -p); this is bash $BASH_VERSION" >&2
    exit 2
fi

usage() {
    echo "usage: $0 NUM_PROCESSES SCRIPT.py [ARGS...]  (or: NUM_PROCESSES -m package.module [ARGS...], NUM_PROCESSES -c CODE [ARGS...])" >&2
    exit 2
}

[[ $# -ge 2 ]] || usage
nprocs=$1
shift
[[ $nprocs =~ ^[1-9][0-9]*$ ]] || usage

python=${PYTHON:-python3}
timeout_s=${LAUNCH_TIMEOUT:-1800}
grace_s=${LAUNCH_GRACE:-10}
kill_after_s=${LAUNCH_KILL_AFTER:-5}
for knob in LAUNCH_TIMEOUT="$timeout_s" LAUNCH_GRACE="$grace_s" LAUNCH_KILL_AFTER="$kill_after_s"; do
    [[ ${knob#*=} =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "$0: ${knob%%=*} must be seconds; got '${knob#*=}'" >&2; exit 2; }
done
read -r -a run <<< "$python"  # PYTHON may carry interpreter options: PYTHON="python3 -X dev"
if [[ ${LAUNCH_FAIL_FAST:-1} != 0 ]]; then
    if [[ $1 == -* && $1 != -m && $1 != -c ]]; then  # an interpreter option: failfast.py cannot go after it
        echo "$0: '$1' is an interpreter option; put it and its value in PYTHON (e.g. PYTHON=\"python3 -X dev\"), or set" \
             "LAUNCH_FAIL_FAST=0 to run without failfast.py (a failed rank then waits in jax's shutdown)" >&2
        exit 2
    fi
    run+=("$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/failfast.py")
fi
port=${LAUNCH_PORT:-$("${run[0]}" -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

pids=()
declare -A rank_of=()
killer=""  # the grace timer, once a process failed

stop_all() {
    local pid
    for pid in "${pids[@]}"; do
        kill -TERM "$pid" 2>/dev/null  # timeout(1) passes it on, and KILLs $kill_after_s s later
    done
}

cleanup() {
    trap - EXIT INT TERM
    stop_all
    [[ -z $killer ]] || kill "$killer" 2>/dev/null
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
        timeout -k "$kill_after_s" "$timeout_s" "${run[@]}" "$@" \
        > >(sed -u "s/^/[rank $rank] /") 2> >(sed -u "s/^/[rank $rank] /" >&2) &
    pids+=($!)
    rank_of[$!]=$rank
done

status=0
while ((${#pids[@]} > 0)); do
    finished=""
    wait -n -p finished "${pids[@]}" 2>/dev/null  # bash's "Killed ..." job notice: reported below
    rc=$?
    if [[ -z $finished ]]; then
        ((rc > 128)) && continue  # interrupted by a signal
        echo "$0: wait -n failed (status $rc)" >&2
        exit 2
    fi
    for i in "${!pids[@]}"; do
        [[ ${pids[$i]} == "$finished" ]] && unset "pids[$i]"
    done
    if ((rc != 0 && status == 0)); then
        status=$rc
        echo "launch.sh: rank ${rank_of[$finished]} (pid $finished) exited with status $rc" >&2
        if ((${#pids[@]} > 0)); then  # the others may be stuck in a collective with it
            (
                # The sleep must not outlive this subshell: it would hold the launcher's stdout and
                # stderr open, and whoever reads them would wait for it.
                trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM
                sleep "$grace_s" </dev/null >/dev/null 2>&1 &
                sleeper=$!
                wait "$sleeper"
                echo "launch.sh: stopping the remaining processes ${grace_s}s after the failure" \
                     "(SIGTERM, SIGKILL ${kill_after_s}s later)" >&2
                kill -TERM "${pids[@]}" 2>/dev/null
            ) &
            killer=$!
        fi
    fi
done
exit "$status"  # cleanup stops the grace timer
