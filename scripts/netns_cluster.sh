#!/usr/bin/env bash
# Several "hosts" on one Linux machine, for trying multi-host Horovod runs for real: one network namespace per host,
# joined by veth pairs to a bridge on a private test subnet, each host running its own sshd with a key made for the
# run. Needs root, iproute2 and OpenSSH's server (installed from apt on Debian/Ubuntu when missing).
#
#   scripts/netns_cluster.sh up DIR [N] [SUBNET]   N hosts (default 2) named host0, host1, ... on SUBNET.0/24
#                                                  (default 10.213.N.0/24, N from the PID); state goes in DIR
#   scripts/netns_cluster.sh run DIR HOST CMD...   run CMD on HOST (inside its namespace), e.g. a launcher
#   scripts/netns_cluster.sh down DIR              kill every process in the namespaces, remove everything
#
# After "up", DIR holds: hosts (one "NAME ADDRESS" line per host), hostfile (NAME slots=1), id_ed25519 (the client
# key), ssh_config, bin/ssh (ssh with that config: put DIR/bin first in PATH for horovodrun, or pass it to mpirun
# as -mca plm_rsh_agent DIR/bin/ssh), env (shell lines: NETNS_PREFIX, NETNS_SUBNET), and cgroups.sh (below: a host's
# processes see their cgroup limits). Each host's /etc/hosts
# (ip netns exec bind-mounts /etc/netns/NS/hosts over it) names every host and maps this machine's hostname to the
# host's own address: Horovod 0.28.1's Gloo context for process sets ignores HOROVOD_GLOO_IFACE and connects to the
# hostname.
# Traffic stays between the namespaces and the bridge; nothing is routed.
set -euo pipefail

die() { echo "netns_cluster: $*" >&2; exit 2; }

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: $0 up|run|down DIR ..."

need_root() {
  [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
  command -v ip >/dev/null || die "needs iproute2 (ip)"
}

ensure_sshd() {
  [ -x /usr/sbin/sshd ] && command -v ssh-keygen >/dev/null && return
  if command -v apt-get >/dev/null; then
    echo "netns_cluster: installing openssh-server (apt-get)" >&2
    local apt; apt="$(dirname "$0")/apt_get.sh"  # waits while another apt holds the lock
    bash "$apt" install -y -q openssh-server >/dev/null 2>&1 \
      || { bash "$apt" update -q >/dev/null && bash "$apt" install -y -q openssh-server >/dev/null; }
  fi
  [ -x /usr/sbin/sshd ] && command -v ssh-keygen >/dev/null \
    || die "needs OpenSSH's server and client (/usr/sbin/sshd, ssh-keygen): install openssh-server"
}

up() {
  local n=${1:-2} subnet=${2:-}
  need_root
  ensure_sshd
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ -e "$dir/env" ] && die "$dir already holds a cluster: run '$0 down $dir' first"
  local id=$(( $$ % 200 + 20 ))
  local prefix="hvdt${id}"
  subnet=${subnet:-10.213.${id}}
  printf 'NETNS_PREFIX=%s\nNETNS_SUBNET=%s\n' "$prefix" "$subnet" > "$dir/env"
  trap 'down_quiet' ERR

  ssh-keygen -q -t ed25519 -N "" -f "$dir/id_ed25519" -C "hvdtrain-test" </dev/null
  ssh-keygen -q -t ed25519 -N "" -f "$dir/host_key" -C "hvdtrain-test-host" </dev/null
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  chmod 600 "$dir/authorized_keys"
  cat > "$dir/ssh_config" <<EOF
Host *
  IdentityFile $dir/id_ed25519
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 5
EOF
  mkdir -p "$dir/bin"
  # The wrapper names the system ssh by its full path, so DIR/bin can come first in PATH.
  printf '#!/bin/sh\nexec %s -F "%s" "$@"\n' "$(command -v ssh)" "$dir/ssh_config" > "$dir/bin/ssh"
  chmod +x "$dir/bin/ssh"

  ip link add "${prefix}br" type bridge
  ip addr add "${subnet}.1/24" dev "${prefix}br"
  ip link set "${prefix}br" up

  : > "$dir/hosts"; : > "$dir/hostfile"
  local i
  for ((i = 0; i < n; i++)); do
    echo "host$i ${subnet}.$((i + 10))" >> "$dir/hosts"
    echo "host$i slots=1" >> "$dir/hostfile"
  done
  local hn; hn=$(hostname)
  for ((i = 0; i < n; i++)); do
    local ns="${prefix}h$i" addr="${subnet}.$((i + 10))"
    ip netns add "$ns"
    ip link add "${prefix}v$i" type veth peer name eth0 netns "$ns"
    ip link set "${prefix}v$i" master "${prefix}br" up
    ip netns exec "$ns" ip addr add "$addr/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
    mkdir -p "/etc/netns/$ns"
    { echo "127.0.0.1 localhost"; echo "$addr $hn"; awk '{print $2, $1}' "$dir/hosts"; } > "/etc/netns/$ns/hosts"
    cat > "$dir/sshd_config.$i" <<EOF
ListenAddress $addr
Port 22
HostKey $dir/host_key
AuthorizedKeysFile $dir/authorized_keys
PidFile $dir/sshd.$i.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv *
PermitUserEnvironment no
MaxStartups 100:30:200
MaxSessions 100
EOF
  done
  write_cgroups_script
  mkdir -p /run/sshd
  for ((i = 0; i < n; i++)); do
    ip netns exec "${prefix}h$i" sh "$dir/cgroups.sh" /usr/sbin/sshd -f "$dir/sshd_config.$i" -E "$dir/sshd.$i.log"
  done
  # Every host reaches every other one over ssh before we say it is up.
  for ((i = 0; i < n; i++)); do
    local name addr
    read -r name addr < <(sed -n "$((i + 1))p" "$dir/hosts")
    local tries=0
    until ip netns exec "${prefix}h0" ssh -F "$dir/ssh_config" "$name" true 2>/dev/null; do
      tries=$((tries + 1))
      [ $tries -lt 50 ] || die "sshd on $name ($addr) does not answer; see $dir/sshd.$i.log"
      sleep 0.1
    done
  done
  trap - ERR
  echo "netns_cluster: $n hosts up: $(awk '{printf "%s=%s ", $1, $2}' "$dir/hosts")(state in $dir)"
}

# DIR/cgroups.sh CMD...: mount this machine's cgroup hierarchies again, then exec CMD. ip netns exec mounts a new
# /sys for the namespace, without the cgroup file systems under /sys/fs/cgroup, so a process on a host could not read
# its own CPU quota (cpu.cfs_quota_us, cpu.max) as it can in a container or a Slurm job; what reads the quota (hvdtrain's
# threads per rank and its choice of how Horovod waits) would then see none. Every process a host's sshd starts, and
# every command run on a host, sees them again.
write_cgroups_script() {
  {
    echo '#!/bin/sh'
    echo '# hvdtrain netns_cluster: the machine cgroup mounts, then the command'
    awk '$2 == "/sys/fs/cgroup" && $3 == "tmpfs" {printf "mount -t tmpfs -o %s %s %s\n", $4, $1, $2}' /proc/self/mounts
    awk '$3 == "cgroup" || $3 == "cgroup2" {printf "mkdir -p %s 2>/dev/null; mount -t %s -o %s %s %s\n", $2, $3, $4, $1, $2}' \
      /proc/self/mounts
    echo 'exec "$@"'
  } > "$dir/cgroups.sh"
}

run_on() {
  local host=$1; shift
  # shellcheck disable=SC1091
  . "$dir/env"
  local i=${host#host}
  exec ip netns exec "${NETNS_PREFIX}h$i" sh "$dir/cgroups.sh" "$@"
}

down_quiet() { down 2>/dev/null || true; }

down() {
  [ -e "$dir/env" ] || return 0
  # shellcheck disable=SC1091
  . "$dir/env"
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${NETNS_PREFIX}h" || true); do
    # Every process left in the host (sshd, workers a failed launch left behind) goes with it.
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip link del "${NETNS_PREFIX}v${ns##*h}" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  ip link del "${NETNS_PREFIX}br" 2>/dev/null || true
  rm -f "$dir/env"
}

case "$cmd" in
  up) shift 2; up "$@" ;;
  run) shift 2; [ $# -ge 2 ] || die "usage: $0 run DIR HOST CMD..."; run_on "$@" ;;
  down) need_root; down ;;
  *) die "unknown command $cmd (up, run, down)" ;;
esac
