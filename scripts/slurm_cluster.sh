#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for tests (tests/slurm/conftest.py uses it).
#
#   bash scripts/slurm_cluster.sh install     # apt-get install Slurm + MUNGE if missing
#   bash scripts/slurm_cluster.sh start DIR   # prints: export SLURM_CONF=DIR/slurm.conf
#   bash scripts/slurm_cluster.sh stop DIR    # idempotent
#
# Debian 12's slurmctld/slurmd/slurm-client 22.05 and munge, run as root without systemd or
# cgroups (proctrack/linuxproc, task/none). The node is this host, NodeName=$(hostname -s) with
# CPUs=$(nproc), in one partition "debug" with OverSubscribe=YES. Open MPI ranks start with
# `srun --mpi=pmix` (MpiDefault=pmix; Debian's Open MPI 4.1 is built with PMIx); more tasks than
# CPUs need `srun -O`. Everything the cluster writes (slurm.conf, state, spool, logs, PID files)
# lies in DIR, so a second cluster after `stop` starts clean in a new DIR.
#
# install: exits 3, with a one-line reason as the last line on stderr, when Slurm is missing
#   and cannot be installed (not root, no apt-get, apt-get failed); the tests skip on that.
# start: reuses a running munged or starts one (as user munge, socket in /run/munge; creates
#   /etc/munge/munge.key if absent), then slurmctld and slurmd; waits until the node is idle;
#   prints the export line on stdout (messages go to stderr). Fails with the daemons' log tails
#   when the node does not come up in $SLURM_CLUSTER_TIMEOUT seconds (default 60).
# stop: cancels the jobs still in DIR's cluster (and only those), stops slurmd and slurmctld by
#   their PID files (TERM, then KILL), and stops munged only when this script started it and no
#   other slurmctld is running on the machine.
#
# Settings (environment, all optional):
#   SLURM_CLUSTER_PORT     first port tried for slurmctld (default 6817; slurmd gets the next
#                          one); when a port is taken the next pair is tried, so two clusters
#                          can run side by side
#   SLURM_CLUSTER_TIMEOUT  seconds to wait for the node to come up (default 60)
#   SLURM_CLUSTER_CRED_EXPIRE  AuthInfo=cred_expire (default 15, Slurm's minimum 5, its default
#                          120): a job put back by `scontrol requeue` waits that long + 1 s
#                          (Reason=BeginTime) before it can start again
set -euo pipefail

PROG=slurm_cluster.sh
PACKAGES=(slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins libpmix-dev)
# slurm-wlm-basic-plugins holds mpi_pmix.so (-> mpi_pmix_v4.so), which dlopens
# /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so: that unversioned link is in libpmix-dev.
COMMANDS=(slurmctld slurmd srun sinfo scontrol squeue scancel munged munge unmunge)
MUNGE_SOCKET=/run/munge/munge.socket.2
MUNGE_PIDFILE=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
DAEMON_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# the daemons live in /usr/sbin, which a non-login PATH may lack
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac

say() { echo "$PROG: $*" >&2; }
die() { say "error: $*"; exit 1; }
cannot_install() { say "cannot install Slurm: $*"; exit 3; }

usage() {
    sed -n '2,6p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------
# install

missing_parts() {
    local c p path
    for c in "${COMMANDS[@]}"; do
        path=$(type -P "$c" 2>/dev/null || true)
        [[ -n $path && -x $path ]] || echo "command $c"
    done
    if command -v dpkg-query >/dev/null 2>&1; then
        for p in "${PACKAGES[@]}"; do
            [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true) == "install ok installed" ]] \
                || echo "package $p"
        done
    fi
}

do_install() {
    local missing
    missing=$(missing_parts)
    if [[ -z $missing ]]; then
        say "Slurm and MUNGE are installed ($(slurm_version))"
        return 0
    fi
    say "missing: $(echo "$missing" | paste -sd, - | sed 's/,/, /g')"
    [[ $(id -u) -eq 0 ]] || cannot_install "not root (uid $(id -u)): apt-get install ${PACKAGES[*]} needs root"
    [[ -x $(type -P apt-get 2>/dev/null || true) ]] || cannot_install "no apt-get on this machine (a Debian/Ubuntu package manager is needed)"
    local log policy_added=0
    log=$(mktemp /tmp/slurm_cluster-install.XXXXXX.log)
    # No init system here: keep the packages' postinst scripts from starting the daemons.
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        policy_added=1
    fi
    local t0=$SECONDS rc=0
    say "apt-get update (log: $log)"
    if ! apt-get -o DPkg::Lock::Timeout=300 update >>"$log" 2>&1; then
        rc=1
    else
        say "apt-get install ${PACKAGES[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y \
            --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1 || rc=2
    fi
    if [[ $policy_added -eq 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi
    if [[ $rc -ne 0 ]]; then
        tail -n 15 "$log" | sed 's/^/  | /' >&2
        if [[ $rc -eq 1 ]]; then cannot_install "apt-get update failed (log: $log)"; fi
        cannot_install "apt-get install ${PACKAGES[*]} failed (log: $log)"
    fi
    missing=$(missing_parts)
    [[ -z $missing ]] || cannot_install "still missing after apt-get install: $(echo "$missing" | paste -sd, -) (log: $log)"
    say "installed in $((SECONDS - t0)) s: $(slurm_version)"
    rm -f "$log"
}

slurm_version() {
    dpkg-query -W -f='${Package} ${Version}\n' "${PACKAGES[@]}" 2>/dev/null | paste -sd, - | sed 's/,/, /g'
}

# ---------------------------------------------------------------------------------------------
# munge

munge_works() {
    munge -n --socket="$MUNGE_SOCKET" 2>/dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1
}

ensure_munged() {
    local dir=$1
    if munge_works; then
        say "munged: reusing the running daemon ($MUNGE_SOCKET)"
        return 0
    fi
    getent passwd munge >/dev/null || die "no user munge (is the munge package installed?)"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    install -d -o munge -g munge -m 0700 /etc/munge
    if [[ ! -s $MUNGE_KEY ]]; then
        say "munged: creating $MUNGE_KEY"
        mungekey --create --keyfile="$MUNGE_KEY" 2>/dev/null \
            || dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none
        chown munge:munge "$MUNGE_KEY"
        chmod 0400 "$MUNGE_KEY"
    fi
    # A munged that died leaves its socket and PID file behind: --force takes them over.
    say "munged: starting (as user munge)"
    env -i PATH="$DAEMON_PATH" runuser -u munge -- munged --force </dev/null >>"$dir/munged.out" 2>&1 \
        || { tail -n 20 "$dir/munged.out" /var/log/munge/munged.log 2>/dev/null >&2 || true
             die "munged did not start"; }
    local i
    for ((i = 0; i < 50; i++)); do
        if munge_works; then
            cat "$MUNGE_PIDFILE" >"$dir/munged.started" 2>/dev/null || echo unknown >"$dir/munged.started"
            return 0
        fi
        sleep 0.2
    done
    tail -n 20 /var/log/munge/munged.log >&2 2>/dev/null || true
    die "munged started but munge -n | unmunge fails"
}

# ---------------------------------------------------------------------------------------------
# start / stop

port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

pick_ports() {
    local port=${SLURM_CLUSTER_PORT:-6817} i
    for ((i = 0; i < 50; i++, port += 2)); do
        if ! port_taken "$port" && ! port_taken $((port + 1)); then
            echo "$port $((port + 1))"
            return 0
        fi
    done
    die "no free pair of ports from ${SLURM_CLUSTER_PORT:-6817} to $port"
}

write_conf() {
    local dir=$1 host=$2 cpus=$3 ctld_port=$4 slurmd_port=$5
    local cred_expire=${SLURM_CLUSTER_CRED_EXPIRE:-15}
    cat >"$dir/slurm.conf" <<EOF
# Written by scripts/slurm_cluster.sh start $dir: a one-node test cluster on $host.
ClusterName=hvdtrain
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only when its credential has expired (default 120 s).
AuthInfo=cred_expire=$cred_expire
CryptoType=crypto/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/slurmd
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Look at pending jobs every 2 s, not 60 (a requeued job's BeginTime passes without an event).
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=pmix
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmdTimeout=60
SlurmctldTimeout=60
MessageTimeout=10
InactiveLimit=0
MailProg=/bin/true
# The node is what this file says (CPUs=$cpus), whatever slurmd detects (no drain on mismatch).
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

# The PID in FILE when that process is alive and its command is NAME.
live_pid() {
    local file=$1 name=$2 pid
    [[ -s $file ]] || return 1
    pid=$(tr -dc '0-9' <"$file")
    [[ -n $pid && -r /proc/$pid/comm ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    alive "$pid" || return 1
    echo "$pid"
}

# PID is running (a zombie, exited but not yet reaped by init, is not).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}

stop_daemon() {
    local file=$1 name=$2 pid i
    pid=$(live_pid "$file" "$name") || { rm -f "$file"; return 0; }
    say "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        alive "$pid" || break
        sleep 0.2
    done
    if alive "$pid"; then
        say "$name (pid $pid) still running after 20 s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$file"
}

log_tails() {
    local dir=$1 f
    for f in "$dir/slurmctld.log" "$dir/slurmd.log" "$dir/slurmctld.out" "$dir/slurmd.out"; do
        [[ -s $f ]] || continue
        echo "--- last lines of $f:" >&2
        tail -n 25 "$f" >&2
    done
}

node_state() {
    SLURM_CONF=$1/slurm.conf timeout 15 sinfo -h -n "$2" -o %T 2>/dev/null | head -n 1 || true
}

do_start() {
    local dir=$1
    do_install
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd -P)
    local host cpus
    host=$(hostname -s)
    cpus=$(nproc)
    if live_pid "$dir/slurmctld.pid" slurmctld >/dev/null && live_pid "$dir/slurmd.pid" slurmd >/dev/null; then
        say "already running in $dir"
        echo "export SLURM_CONF=$dir/slurm.conf"
        return 0
    fi
    stop_daemon "$dir/slurmd.pid" slurmd
    stop_daemon "$dir/slurmctld.pid" slurmctld
    mkdir -p "$dir/state" "$dir/spool/slurmd"
    chmod 0755 "$dir/spool" "$dir/spool/slurmd"
    local ports
    ports=$(pick_ports)
    write_conf "$dir" "$host" "$cpus" ${ports% *} ${ports#* }
    say "cluster in $dir: node $host, $cpus CPUs, ports ${ports/ /, }"

    ensure_munged "$dir"

    local t0=$SECONDS timeout=${SLURM_CLUSTER_TIMEOUT:-60}
    say "starting slurmctld"
    env -i PATH="$DAEMON_PATH" HOME="${HOME:-/root}" \
        slurmctld -f "$dir/slurm.conf" </dev/null >>"$dir/slurmctld.out" 2>&1 \
        || { log_tails "$dir"; die "slurmctld -f $dir/slurm.conf failed"; }
    local i ok=0
    for ((i = 0; i < timeout * 2; i++)); do
        if SLURM_CONF=$dir/slurm.conf timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then ok=1; break; fi
        live_pid "$dir/slurmctld.pid" slurmctld >/dev/null || [[ $i -lt 10 ]] || break
        sleep 0.5
    done
    [[ $ok -eq 1 ]] || { log_tails "$dir"; do_stop "$dir" quiet
                         die "slurmctld did not answer scontrol ping"; }
    say "starting slurmd"
    env -i PATH="$DAEMON_PATH" HOME="${HOME:-/root}" \
        slurmd -f "$dir/slurm.conf" </dev/null >>"$dir/slurmd.out" 2>&1 \
        || { log_tails "$dir"; do_stop "$dir" quiet; die "slurmd -f $dir/slurm.conf failed"; }

    local state resumed=0
    while ((SECONDS - t0 < timeout)); do
        state=$(node_state "$dir" "$host")
        case $state in
            idle | mixed | allocated)
                say "node $host is $state after $((SECONDS - t0)) s"
                echo "export SLURM_CONF=$dir/slurm.conf"
                return 0
                ;;
            down* | drain* | drained*)
                if [[ $resumed -eq 0 ]] && live_pid "$dir/slurmd.pid" slurmd >/dev/null; then
                    say "node $host is $state: scontrol update state=resume"
                    SLURM_CONF=$dir/slurm.conf timeout 15 scontrol update nodename="$host" state=resume >&2 || true
                    resumed=1
                fi
                ;;
        esac
        sleep 1
    done
    say "node $host is '${state:-unknown}' after $timeout s"
    SLURM_CONF=$dir/slurm.conf timeout 15 scontrol show node "$host" >&2 2>/dev/null || true
    log_tails "$dir"
    do_stop "$dir" quiet
    die "the cluster in $dir did not come up"
}

do_stop() {
    local dir=$1 quiet=${2:-}
    if [[ ! -d $dir ]]; then
        say "nothing to stop: no directory $dir"
        return 0
    fi
    dir=$(cd "$dir" && pwd -P)
    # Jobs left in this cluster (a test that timed out) would keep their ranks running after
    # slurmd is gone: cancel them, this cluster's only (SLURM_CONF names it).
    if live_pid "$dir/slurmctld.pid" slurmctld >/dev/null; then
        local jobs i
        jobs=$(SLURM_CONF=$dir/slurm.conf timeout 15 squeue -h -o %i 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            say "cancelling jobs left in $dir: $(echo "$jobs" | paste -sd' ' -)"
            SLURM_CONF=$dir/slurm.conf timeout 15 scancel --signal=KILL --full $jobs 2>/dev/null || true
            SLURM_CONF=$dir/slurm.conf timeout 15 scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 20; i++)); do
                [[ -z $(SLURM_CONF=$dir/slurm.conf timeout 15 squeue -h -t R,CG,S -o %i 2>/dev/null || true) ]] && break
                sleep 0.5
            done
        fi
    fi
    stop_daemon "$dir/slurmd.pid" slurmd
    stop_daemon "$dir/slurmctld.pid" slurmctld
    if [[ -f $dir/munged.started ]]; then
        local others="" pid
        for pid in $(pgrep -x slurmctld 2>/dev/null || true); do
            alive "$pid" && others="$others $pid"
        done
        if [[ -z $others ]]; then
            say "stopping munged (started by $PROG start $dir)"
            munged --stop --socket="$MUNGE_SOCKET" >/dev/null 2>&1 || true
        else
            say "leaving munged running: another slurmctld uses it (pid${others})"
        fi
        rm -f "$dir/munged.started"
    fi
    [[ -n $quiet ]] || say "stopped the cluster in $dir"
}

main() {
    [[ $# -ge 1 ]] || usage
    case $1 in
        install) [[ $# -eq 1 ]] || usage; do_install ;;
        start) [[ $# -eq 2 ]] || usage; do_start "$2" ;;
        stop) [[ $# -eq 2 ]] || usage; do_stop "$2" ;;
        -h | --help | help) usage ;;
        *) usage ;;
    esac
}

main "$@"
