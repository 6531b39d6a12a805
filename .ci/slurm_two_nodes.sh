#!/usr/bin/env bash
# A real two-node Slurm on localhost for tests/test_slurm_teachers.py's node split (a served
# teacher on one node, the trainer on the other): two slurmd daemons on this machine (`slurmd
# -N`), named after two names that resolve here, $(hostname -s) and localhost. A cluster of its
# own beside .ci/slurm.sh's one-node Slurm: its own config, ports and state under $ROOT, reached
# with SLURM_CONF=$ROOT/slurm.conf. Needs .ci/slurm.sh first (the packages, munge).
#
# Idempotent: rewrites the config only when it changed (restarting the daemons then), starts
# whichever daemon is not running, and returns once both nodes are idle.
set -euo pipefail
ROOT=${OPD_SLURM_TWO_NODES:-/var/lib/opd-slurm-2nodes}
CONF=$ROOT/slurm.conf
HOST=$(hostname -s)
NODES=("$HOST" localhost)
export SLURM_CONF=$CONF

log() { echo "slurm_two_nodes.sh: $*" >&2; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

[[ $HOST != localhost ]] || { log "the host is named localhost: no second name for a node"; exit 1; }
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "munge does not answer; run bash .ci/slurm.sh first"
    exit 1
fi
cpus=$(nproc)
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.4)}' /proc/meminfo)  # each of the two
wanted=$(cat <<CONFIG
# Written by .ci/slurm_two_nodes.sh: two nodes on localhost for the served teacher's node split.
ClusterName=opd-ci-two-nodes
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=cred_expire=20
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
KillWait=30
MinJobAge=600
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool-%n
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd-%n.pid
SlurmctldLogFile=$ROOT/slurmctld.log
SlurmdLogFile=$ROOT/slurmd-%n.log
NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=16821 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=16822 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONFIG
)
mkdir -p "$ROOT/state" "$ROOT/spool-${NODES[0]}" "$ROOT/spool-${NODES[1]}"
pidfiles=("$ROOT/slurmctld.pid" "$ROOT/slurmd-${NODES[0]}.pid" "$ROOT/slurmd-${NODES[1]}.pid")
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$wanted" ]]; then
    log "writing $CONF"
    for pidfile in "${pidfiles[@]}"; do
        alive "$pidfile" && kill "$(cat "$pidfile")"
    done
    for _ in $(seq 60); do
        any=0
        for pidfile in "${pidfiles[@]}"; do alive "$pidfile" && any=1; done
        ((any)) || break
        sleep 0.5
    done
    printf '%s\n' "$wanted" > "$CONF"
fi
alive "$ROOT/slurmctld.pid" || { log "starting slurmctld"; slurmctld -c -f "$CONF"; }
for node in "${NODES[@]}"; do
    alive "$ROOT/slurmd-$node.pid" || { log "starting slurmd $node"; slurmd -N "$node" -f "$CONF"; }
done
for _ in $(seq 120); do
    idle=$(sinfo -h -o "%T %D" 2>/dev/null | awk '$1 == "idle" {print $2}')
    [[ $idle == 2 ]] && exit 0
    for node in "${NODES[@]}"; do
        case $(sinfo -h -n "$node" -o %T 2>/dev/null) in
            down*|drain*|fail*) scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
        esac
    done
    sleep 0.5
done
log "the two nodes did not become idle within 60 s; see $ROOT/*.log"
exit 1
