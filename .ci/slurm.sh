#!/usr/bin/env bash
# A real one-node Slurm on localhost for tests/test_slurm.py: munge + slurmctld + slurmd.
#
# Idempotent and cheap when already up: installs Debian's slurm-wlm and munge only when their
# binaries are absent, rewrites slurm.conf only when it changed (restarting the daemons then),
# starts whichever daemon is not running, and returns once `sinfo` shows the node idle.
# Runs as root (CI and the dev machines are root; SlurmUser=root keeps it to one user).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
LOGS=/var/log/slurm
HOST=$(hostname -s)

log() { echo "slurm.sh: $*" >&2; }

fail() {
    log "$*"
    for file in "$LOGS/slurmctld.log" "$LOGS/slurmd.log"; do
        [[ -f $file ]] && { log "last lines of $file:"; tail -n 20 "$file" >&2; }
    done
    exit 1
}

alive() {  # alive PIDFILE: the daemon whose pid it holds is running
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null
fi

# munge: the key must be private to the munge user or munged refuses it; munged runs as root
# (--force) like the Slurm daemons.
if [[ ! -s /etc/munge/munge.key ]]; then
    install -d -o munge -g munge -m 700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    munged --force
fi

# The node gets the machine's CPUs and most of its memory (slurmd drains a node that claims more).
cpus=$(nproc)
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
wanted=$(cat <<EOF
# Written by .ci/slurm.sh: one node on localhost for the project's tests.
ClusterName=opd-ci
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
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
# Preemption-safe runs requeue themselves (scontrol requeue).
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
mkdir -p /etc/slurm "$LOGS" /var/lib/slurm/slurmctld /var/lib/slurm/slurmd
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$wanted" ]]; then
    log "writing $CONF"
    if alive /run/slurmctld.pid || alive /run/slurmd.pid; then
        scontrol shutdown >/dev/null 2>&1 || true
        for _ in $(seq 60); do
            alive /run/slurmctld.pid || alive /run/slurmd.pid || break
            sleep 0.5
        done
    fi
    printf '%s\n' "$wanted" > "$CONF"
fi

if ! alive /run/slurmctld.pid; then
    log "starting slurmctld"
    slurmctld -c  # -c: a fresh start forgets jobs left over from an earlier run
fi
if ! alive /run/slurmd.pid; then
    log "starting slurmd"
    slurmd
fi

for _ in $(seq 120); do
    state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
    case $state in
        idle|mixed|allocated) exit 0 ;;
        down*|drain*|fail*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
done
fail "node $HOST did not become idle within 60 s (sinfo says '${state:-nothing}')"
