#!/usr/bin/env bash
# A real Slurm cluster on one Linux machine, for testing what Slurm launches: the network-namespace hosts of
# scripts/netns_cluster.sh, slurmctld on host0 and a slurmd on every host, one munged for all. Needs root, iproute2,
# util-linux (unshare, nsenter) and Debian's slurmctld, slurmd, slurm-client and munge (installed with apt-get when
# missing). No cgroups are used: processes are tracked by their parent (proctrack/linuxproc) and bound to cores by
# task/affinity.
#
#   scripts/slurm_cluster.sh up DIR [N]       N hosts (default 2) host0..hostN-1, state in DIR; a cluster left there
#                                             by a killed run is taken down first
#   scripts/slurm_cluster.sh run DIR CMD...   CMD on host0 (the login node), with SLURM_CONF set: sbatch, srun, ...
#   scripts/slurm_cluster.sh node DIR HOST kill|start   kill a node's slurmd (its job steps go on), or start it again
#   scripts/slurm_cluster.sh down DIR         stop every daemon and job, remove the hosts, the spool and the state
#
# After "up", DIR holds slurm.conf (SLURM_CONF=DIR/slurm.conf for the client commands), log/ (slurmctld.log,
# slurmd-hostN.log), net/ (the netns_cluster.sh state: hosts, hostfile, bin/ssh for horovodrun or mpirun over ssh).
# Two traps of Slurm on namespace hosts, handled here:
#   - slurmd must not be started with 'ip netns exec', which remounts /sys ("No filesystem mounted on
#     /sys/fs/cgroup"): each daemon enters its host's network namespace with nsenter instead, inside a private mount
#     namespace (unshare) where the host's own /etc/hosts is bind-mounted (every namespace shares the machine's
#     hostname, which must resolve to the host's own address there, as ip netns exec would arrange).
#   - every slurmd shares /tmp, and mpi/pmix creates /tmp/spmix_appdir_<uid>_<job>.<step> on each node: the second
#     fails ("File exists"). TmpFS points at DIR/tmpfs, and each slurmd's mount namespace binds its own directory
#     over it.
# Every daemon runs in a session of its own (setsid); "down" stops them all. A bring-up that fails anywhere (a daemon
# that does not start, nodes not idle within UP_TIMEOUT seconds, default 30) takes down everything it made: daemons,
# namespaces, spool, and the MUNGE key and directories it created (listed in DIR/munge-created).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
NETNS="$HERE/netns_cluster.sh"
die() { echo "slurm_cluster: $*" >&2; exit 2; }

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: $0 up|run|down DIR ..."

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network and mount namespaces)"
  command -v nsenter >/dev/null && command -v unshare >/dev/null || die "needs util-linux (nsenter, unshare)"
}

ensure_slurm() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v srun >/dev/null \
      && command -v munged >/dev/null; then
    return
  fi
  command -v apt-get >/dev/null || die "needs Slurm and MUNGE (slurmctld, slurmd, slurm-client, munge)"
  echo "slurm_cluster: installing slurmctld slurmd slurm-client munge (apt-get)" >&2
  local apt; apt="$(dirname "$0")/apt_get.sh"  # waits while another apt holds the lock
  bash "$apt" install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || { bash "$apt" update -qq >/dev/null && bash "$apt" install -y -qq slurmctld slurmd \
         slurm-client munge >/dev/null; } || die "apt-get install slurmctld slurmd slurm-client munge failed"
}

munge_up() {
  # One munged (its socket is a file) authenticates every host. Started here only when none answers.
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  # What this script creates of MUNGE's is listed, so that "down" removes it and nothing else.
  local d
  for d in /etc/munge /run/munge /var/lib/munge /var/log/munge; do
    [ -d "$d" ] || { mkdir -p "$d" && echo "$d" >> "$dir/munge-created"; }
  done
  [ -f /etc/munge/munge.key ] || {
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
    chmod 400 /etc/munge/munge.key
    echo /etc/munge/munge.key >> "$dir/munge-created"
  }
  setsid munged --force --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munged.seed" </dev/null
  local tries=0
  until munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; do
    tries=$((tries + 1)); [ $tries -lt 50 ] || die "munged does not answer; see $dir/log/munged.log"; sleep 0.1
  done
}

write_conf() {
  local hn=$1; shift
  local n=$#
  local cpus; cpus=$(nproc)
  {
    echo "# Written by scripts/slurm_cluster.sh for a test cluster on network-namespace hosts."
    echo "ClusterName=hvdtest"
    # every namespace shares this machine's hostname: slurmctld starts only where the name is the controller's
    echo "SlurmctldHost=${hn}($(awk 'NR == 1 {print $2}' "$dir/net/hosts"))"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/slurmctld.pid"
    echo "SlurmdPidFile=$dir/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "TmpFS=$dir/tmpfs"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/affinity"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "MpiDefault=none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "MailProg=/bin/true"
    echo "ReturnToService=2"
    # a node that stops answering is declared down, and its jobs ended, within seconds
    echo "SlurmdTimeout=5"
    echo "MessageTimeout=5"
    echo "KillWait=5"
    echo "InactiveLimit=0"
    echo "SchedulerType=sched/backfill"
    local name addr
    while read -r name addr; do
      echo "NodeName=$name NodeAddr=$addr CPUs=$cpus State=UNKNOWN"
    done < "$dir/net/hosts"
    echo "PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } > "$dir/slurm.conf"
}

# Run "$@" as a daemon of host I: its network namespace, a private mount namespace with the host's /etc/hosts and its
# own TmpFS directory, a session of its own.
start_on() {
  local i=$1; shift
  # shellcheck disable=SC1091
  . "$dir/net/env"
  local ns="${NETNS_PREFIX}h$i"
  mkdir -p "$dir/tmp-host$i"
  setsid unshare --mount --propagation private sh -c '
    mount --bind "$1" "$2" && mount --bind "$3" /etc/hosts && shift 3 && exec "$@"' sh \
    "$dir/tmp-host$i" "$dir/tmpfs" "/etc/netns/$ns/hosts" nsenter --net="/var/run/netns/$ns" "$@" </dev/null \
    || die "$1 did not start on host$i (exit $?); see $dir/log/"
}

up() {
  local n=${1:-2}
  need_root
  ensure_slurm
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [ -e "$dir/slurm.conf" ] || [ -e "$dir/net/env" ]; then
    echo "slurm_cluster: $dir holds an earlier cluster: taking it down first" >&2
    down
  fi
  # Any failure from here on (die, set -e inside a function, a signal) ends the script: its EXIT trap unwinds.
  trap 'echo "slurm_cluster: bring-up failed: taking down what it started" >&2; down >/dev/null 2>&1 || true' EXIT
  mkdir -p "$dir/log" "$dir/state" "$dir/tmpfs"
  bash "$NETNS" up "$dir/net" "$n" >/dev/null
  local hn; hn=$(hostname)
  local i
  for ((i = 0; i < n; i++)); do mkdir -p "$dir/spool/host$i"; done
  write_conf "$hn" $(awk '{print $1}' "$dir/net/hosts")
  munge_up
  start_on 0 slurmctld -f "$dir/slurm.conf"
  for ((i = 0; i < n; i++)); do
    start_on "$i" slurmd -f "$dir/slurm.conf" -N "host$i"
  done
  # up when every node is idle
  local tries=0 states
  while :; do
    states=$(run_on sinfo -h -N -o "%t" 2>/dev/null | sort -u | paste -sd, -)
    [ "$states" = "idle" ] && break
    tries=$((tries + 1))
    [ $tries -lt $(( ${UP_TIMEOUT:-30} * 5 )) ] \
      || die "nodes are not idle after ${UP_TIMEOUT:-30} s (sinfo: ${states:-no answer}); see $dir/log/"
    sleep 0.2
  done
  trap - EXIT
  echo "slurm_cluster: $n nodes up ($(awk '{printf "%s=%s ", $1, $2}' "$dir/net/hosts")); SLURM_CONF=$dir/slurm.conf"
}

run_on() {
  SLURM_CONF="$dir/slurm.conf" bash "$NETNS" run "$dir/net" host0 env SLURM_CONF="$dir/slurm.conf" "$@"
}

kill_pidfile() {
  local f=$1
  [ -f "$f" ] || return 0
  local pid; pid=$(cat "$f" 2>/dev/null || true)
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  rm -f "$f"
}

down() {
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd)
  local f
  for f in "$dir"/slurmctld.pid "$dir"/slurmd-*.pid; do kill_pidfile "$f"; done
  # slurmstepd and job processes of this cluster (they run in the hosts' namespaces, also after a killed slurmd)
  pkill -9 -f "slurm.*$dir/slurm.conf" 2>/dev/null || true
  [ -e "$dir/net/env" ] && bash "$NETNS" down "$dir/net"
  pkill -9 -f "slurmstepd.*$dir" 2>/dev/null || true
  kill_pidfile "$dir/munged.pid"
  if [ -f "$dir/munge-created" ]; then  # newest first: the key before its directory
    tac "$dir/munge-created" | while read -r path; do rm -rf "$path"; done
    rm -f "$dir/munge-created"
  fi
  rm -rf "$dir/spool" "$dir/state" "$dir/tmpfs" "$dir"/tmp-host* "$dir/slurm.conf" "$dir/munged.seed"
}

node() {
  local i=${1#host} action=${2:-}
  case "$action" in
    kill) kill_pidfile "$dir/slurmd-host$i.pid" ;;  # the daemon only: its job steps go on, as on a real node
    start) start_on "$i" slurmd -f "$dir/slurm.conf" -N "host$i" ;;
    *) die "usage: $0 node DIR HOST kill|start" ;;
  esac
}

case "$cmd" in
  up) shift 2; up "$@" ;;
  node) shift 2; need_root; dir=$(cd "$dir" && pwd); node "$@" ;;
  run) shift 2; [ $# -ge 1 ] || die "usage: $0 run DIR CMD..."; dir=$(cd "$dir" && pwd); run_on "$@" ;;
  down) need_root; down ;;
  *) die "unknown command $cmd (up, run, down)" ;;
esac
