#!/usr/bin/env bash
# One launcher per node, started by `srun --ntasks-per-node=1` from the sbatch file that
# launch/submit.py writes: torchrun starts this node's ranks of a static rendezvous whose layout
# comes from Slurm (node count and this node's index) and from the sbatch file (MASTER_ADDR,
# MASTER_PORT).
#
#   node.sh PROCS_PER_NODE PYTHON SCRIPT [ARG ...]
set -euo pipefail
procs_per_node=$1
python=$2
shift 2
: "${MASTER_ADDR:?is not set: the sbatch file exports the first node of the allocation}"
: "${MASTER_PORT:?is not set: the sbatch file derives it from the job id}"

# Slurm's warning signal (--signal=USR1@N) reaches every process of the step: torchrun, the
# ranks and whatever they start (an op's compiler, tool sandboxes, wandb), all of which it kills
# by default. So the whole tree ignores USR1 (an ignored signal stays ignored across exec), and
# this script, which gets it too, relays it to the ranks alone as USR2: they stop at a step
# boundary and checkpoint (opd/preemption.py). USR2 stays ignored until a rank handles it.
trap '' USR1 USR2
export OPD_WARNING_SIGNAL=USR2
"$python" -m torch.distributed.run --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" \
    --nproc_per_node="$procs_per_node" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    --max_restarts=0 "$@" &
launcher=$!

# USR1 or TERM, from Slurm or sent to this script alone (kill, `scancel --batch`), goes on to the
# ranks, the children of torchrun; they checkpoint at the next step boundary and end, and
# torchrun with them. (TERM is not sent to torchrun: it would give the ranks only 30 s before
# killing them.)
forward() { pkill "-$1" -P "$launcher" || true; }
trap 'forward USR2' USR1
trap 'forward TERM' TERM
status=0
while :; do
    wait "$launcher" && status=0 || status=$?
    kill -0 "$launcher" 2>/dev/null || break  # else a trapped signal ended `wait` early
done
exit "$status"
