#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/flashckpt-epilog.sh): stops the node's flashckptd
# that deploy/slurm/prolog.sh started. SIGTERM lets it finish the writes in flight (its
# --stop-timeout, 240 s there); what it cannot finish it leaves for a next daemon with the same
# state directory, which this epilog then removes with the run directory: set the job's
# checkpointing so that its last save is waited for (wait_persisted) before the job ends.
set -uo pipefail

run_dir=/run/flashckpt/${SLURM_JOB_ID:?SLURM_JOB_ID is not set: run this as a Slurm epilog}
pid_file=$run_dir/flashckptd.pid
if [ -f "$pid_file" ]; then
    pid=$(cat "$pid_file")
    if kill -TERM "$pid" 2>/dev/null; then
        for _ in $(seq 1 2500); do   # the stop timeout and 10 s more
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
fi
rm -rf "$run_dir"
exit 0
