#!/bin/bash
# One torchrun agent per node, joining the others by c10d rendezvous on the job's first node.
#
#   launchers/slurm/launch.sh --config configs/x.yaml [key=value ...]
#
# srun runs it once per node from train_ppo.sbatch; it runs without Slurm too when the variables
# below are set by hand (tests/integration/test_slurm.py runs two "nodes" on one CPU machine).
#
# Read from the environment:
#   SLURM_JOB_NODELIST SLURM_NNODES SLURM_NODEID SLURM_JOB_ID   the job (set by Slurm)
#   GPUS_PER_NODE    processes per node; default NPROC_PER_NODE, else the visible GPUs, else 1 (CPU)
#   MASTER_PORT      rendezvous port on the first node; default 29500 + SLURM_JOB_ID % 1000
#   NCCL_SOCKET_IFNAME  left to the user: NCCL picks an interface itself when it is unset
#   MEGARL_COLLECTIVE_TIMEOUT_MINUTES  how long the agents wait for each other at the rendezvous
#                    (default 30, the collective timeout of megarl's process groups). On GPU a timed-out
#                    collective ends the job, and each rank first dumps its last collectives to the log
#                    folder (torch's flight recorder): they show which phase was stuck.
#   MEGARL_LOG_DIR   per-rank logs (default outputs/slurm/$SLURM_JOB_ID), one folder per node
#   MEGARL_RESUME_MODE  passed as trainer.resume_mode (default auto: a requeued job resumes from its
#                    newest complete checkpoint, a new one starts fresh); after the user's overrides, so
#                    this variable is the way to change it (disable, or path with trainer.resume_path=...)
#   PYTHON           interpreter (default .venv/bin/python when present, else python3)
#
# Preemption: SIGUSR1 (sent by `#SBATCH --signal=USR1@180` before the time limit) stops the workers
# and requeues the job with `scontrol requeue`. SIGTERM (preemption or scancel) only stops them:
# scancel must not requeue, and Slurm itself requeues preempted jobs submitted with --requeue.
set -euo pipefail

cd "$(dirname "$0")/../.."
: "${SLURM_JOB_NODELIST:?not set: run under Slurm, or set SLURM_JOB_NODELIST/SLURM_NNODES/SLURM_NODEID/SLURM_JOB_ID}"
: "${SLURM_NNODES:?not set}" "${SLURM_NODEID:?not set}" "${SLURM_JOB_ID:?not set}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

visible_gpus() {
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

first_node() {
    # The rendezvous host: the first node of the job (node id 0).
    if command -v scontrol >/dev/null; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
    else  # "host", "a,b" or "node[03-07,9]" -> host, a, node03
        sed -E 's/^([^,[]+)(\[([^],-]+))?.*$/\1\3/' <<<"$SLURM_JOB_NODELIST"
    fi
}

num_gpus=$(visible_gpus)
nproc=${GPUS_PER_NODE:-${NPROC_PER_NODE:-$(( num_gpus > 0 ? num_gpus : 1 ))}}
host=$(first_node)
port=${MASTER_PORT:-$(( 29500 + SLURM_JOB_ID % 1000 ))}
log_dir=${MEGARL_LOG_DIR:-outputs/slurm/$SLURM_JOB_ID}/node$SLURM_NODEID
timeout_minutes=${MEGARL_COLLECTIVE_TIMEOUT_MINUTES:-30}

if (( num_gpus > 0 )); then
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=1  # a failed or timed-out collective ends the job, not hangs it
    export TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$log_dir/nccl_trace_rank_
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    required="core cuda"
else
    export OMP_NUM_THREADS=1  # every rank is a process: threads would oversubscribe the cores
    required="core"
fi

# Fail early and clearly on a missing package; node 0 also prints the full report into the job log.
# shellcheck disable=SC2086  # $required is a list of words
if [[ "$SLURM_NODEID" == 0 ]]; then
    "$PYTHON" -m megarl.doctor --require $required
else
    "$PYTHON" -m megarl.doctor --require $required >/dev/null
fi

child=""
# shellcheck disable=SC2329  # invoked by the traps below
stop() {
    local signal=$1
    echo "megarl launch: node $SLURM_NODEID received SIG$signal, stopping the workers" >&2
    if [[ "$signal" == USR1 && "$SLURM_NODEID" == 0 ]] && command -v scontrol >/dev/null; then
        scontrol requeue "$SLURM_JOB_ID" && echo "megarl launch: requeued job $SLURM_JOB_ID" >&2
    fi
    if [[ -n "$child" ]]; then kill -TERM "$child" 2>/dev/null || true; else exit 143; fi
}
trap 'stop USR1' USR1
trap 'stop TERM' TERM

echo "megarl launch: node $SLURM_NODEID of $SLURM_NNODES, processes per node $nproc, rendezvous $host:$port" \
     "(job $SLURM_JOB_ID), NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<NCCL default>}, logs in $log_dir"
mkdir -p "$log_dir"
# Node 0 hosts the rendezvous store. The c10d rendezvous numbers the nodes in the order they join
# (torchrun ignores --node_rank with it), so global rank 0 may live on any node.
is_host=$([[ "$SLURM_NODEID" == 0 ]] && echo 1 || echo 0)
"$PYTHON" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$nproc" \
    --rdzv_backend=c10d --rdzv_endpoint="$host:$port" --rdzv_id="$SLURM_JOB_ID" \
    --rdzv_conf="is_host=$is_host,join_timeout=$(( timeout_minutes * 60 ))" \
    --log-dir="$log_dir" --tee=3 \
    launchers/train_ppo.py "$@" "trainer.resume_mode=${MEGARL_RESUME_MODE:-auto}" &
child=$!

# `wait` returns early when a trapped signal arrives: wait again for torchrun to finish.
status=0
wait "$child" || status=$?
while kill -0 "$child" 2>/dev/null; do
    status=0
    wait "$child" || status=$?
done
exit "$status"
