#!/usr/bin/env bash
# examples/train_tp_block.py as two processes started by hand (--coordinator/--num-processes/
# --process-id), both on GPU 0 (a one-GPU machine): tp=2 across the processes. Each process is its
# own NCCL host (NCCL refuses two ranks of one host on one GPU). EXTRA1: flags only process 1 gets
# (e.g. "--seed 1", to see both processes stop naming the difference).
#   bash tools/example_two_procs.sh [FLAGS...]      (LIMIT: seconds per process, default 240)
set -uo pipefail
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
logs=$(mktemp -d)
pids=()
for i in 0 1; do
  extra=""; [[ $i == 1 ]] && extra="${EXTRA1:-}"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=0 NCCL_HOSTID="example-rank-$i" NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
    NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.35 \
    timeout -k 5 "${LIMIT:-240}" python3 examples/train_tp_block.py --coordinator "127.0.0.1:$port" \
      --num-processes 2 --process-id "$i" "$@" $extra > "$logs/p$i.log" 2>&1 &
  pids+=($!)
done
status=0
for i in 0 1; do
  wait "${pids[$i]}"; rc=$?
  echo "process $i: exit $rc"
  (( rc != 0 && status == 0 )) && status=$rc
done
for i in 0 1; do sed "s/^/[p$i] /" "$logs/p$i.log" | grep -v "^\[p.\] [WIE][0-9]\{4\}"; done
rm -rf "$logs"
exit "$status"
