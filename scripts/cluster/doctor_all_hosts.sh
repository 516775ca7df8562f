#!/usr/bin/env bash
# python -m hvdtrain doctor on every host of a hostfile, over ssh; exit 0 only when every host passes.
#
#   scripts/cluster/doctor_all_hosts.sh HOSTFILE [DIR]
#
# DIR is where hvdtrain lives on the hosts (default: this checkout's path, as on a shared file system). PYTHON is
# the interpreter there (default DIR/.venv/bin/python).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 HOSTFILE [DIR]" >&2; exit 2; }
hostfile=$1
dir=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
python=${PYTHON:-$dir/.venv/bin/python}
hosts=$(awk '!/^[[:space:]]*#/ && NF {print $1}' "$hostfile") || { echo "cannot read $hostfile" >&2; exit 2; }
failed=0
for host in $hosts; do
  if out=$(ssh -o BatchMode=yes -o ConnectTimeout=10 "$host" "cd '$dir' && '$python' -m hvdtrain doctor" 2>&1); then
    echo "$host: ok"
  else
    failed=$((failed + 1))
    echo "$host: FAILED"
    echo "$out" | sed "s/^/  $host| /"
  fi
done
[ "$failed" = 0 ] || { echo "doctor: $failed host(s) failed" >&2; exit 1; }
echo "doctor: every host passed"
