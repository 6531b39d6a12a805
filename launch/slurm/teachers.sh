#!/usr/bin/env bash
# One per teacher node, started by `srun` from the sbatch file that launch/submit.py writes when
# cluster.teacher_nodes > 0 (opd/slurm_teachers.py): REPLICAS teacher servers
# (python -m opd.teachers.server), the i-th on GPUs i*TP_SIZE .. (i+1)*TP_SIZE-1 of this node's
# and port PORT + i. The first server to end takes the node's others with it; the trainer then
# reports the dead URL after its retries.
#
#   teachers.sh REPLICAS TP_SIZE PORT PYTHON [SERVER ARG ...]
set -euo pipefail
replicas=$1
tp_size=$2
port=$3
python=$4
shift 4
repo="$(cd "$(dirname "$0")/../.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

# Slurm's warning signal (USR1) is for the trainer, which still needs scores to finish its step
# and checkpoint; the servers ignore it (an ignored signal stays ignored across exec).
trap '' USR1 USR2
# The node's GPUs as Slurm lists them, else (no GPU plugin) by index.
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a gpus <<<"$CUDA_VISIBLE_DEVICES"
else
    mapfile -t gpus < <(seq 0 $((replicas * tp_size - 1)))
fi
pids=()
for ((i = 0; i < replicas; i++)); do
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:i * tp_size:tp_size}") "$python" -m opd.teachers.server --port $((port + i)) \
        --tensor-parallel-size "$tp_size" "$@" &
    pids+=($!)
done
stop() { kill "${pids[@]}" 2>/dev/null || true; }
trap 'stop; wait; exit 143' TERM INT
status=0
wait -n || status=$?
stop
wait || true
exit "$status"
