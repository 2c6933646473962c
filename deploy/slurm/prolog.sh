#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/flashckpt-prolog.sh): starts one flashckptd on each
# node of a job, as the job's user, for the job's ranks on that node. Every node's daemon writes the
# same shared root; they never talk to each other (docs/operating.md, "Many nodes, one root").
#
# The trainers find the daemon at /run/flashckpt/$SLURM_JOB_ID/flashckptd.sock (pass it to
# flashckpt.Client / ClientOptions::socket_path) and take SLURM_JOB_ID, which every rank of the job
# sees, as their run id without being told. deploy/slurm/epilog.sh stops the daemon.
set -euo pipefail

FLASHCKPTD=${FLASHCKPTD:-/usr/bin/flashckptd}
ROOT=${FLASHCKPT_ROOT:-/lustre/checkpoints}        # the shared file system, the same path on every node
MEMORY=${FLASHCKPT_MAX_HOST_MEMORY:-64GiB}
run_dir=/run/flashckpt/${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run this as a Slurm prolog}
user=${SLURM_JOB_USER:?SLURM_JOB_USER is not set}

install -d -m 0700 -o "$user" "$run_dir"
# The daemon outlives this script: its own session, its log in the run directory, its pid recorded
# for the epilog. --node-name is the short host name, which `flashckpt list` shows for each rank.
runuser -u "$user" -- setsid "$FLASHCKPTD" \
    --socket "$run_dir/flashckptd.sock" \
    --root "$ROOT" \
    --node-name "$(hostname -s)" \
    --max-host-memory "$MEMORY" \
    --keep 3 \
    --sweep-interval 10 \
    --lease-ttl 60 \
    --stop-timeout 240 \
    --log-file "$run_dir/flashckptd.log" \
    </dev/null >/dev/null 2>&1 &
echo $! > "$run_dir/flashckptd.pid"

# The job starts once the daemon answers (its socket exists), or the prolog fails the node.
for _ in $(seq 1 300); do
    [ -S "$run_dir/flashckptd.sock" ] && exit 0
    kill -0 "$(cat "$run_dir/flashckptd.pid")" 2>/dev/null || { echo "flashckptd exited; see $run_dir/flashckptd.log" >&2; exit 1; }
    sleep 0.1
done
echo "flashckptd did not open $run_dir/flashckptd.sock within 30 s" >&2
exit 1
