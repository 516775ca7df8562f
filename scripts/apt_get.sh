#!/usr/bin/env bash
# apt-get ARGS..., waiting while another apt holds its lock. On a machine that has just booted (a cloud VM's
# unattended upgrades) or beside another installer, apt-get fails at once: "Could not get lock
# /var/lib/apt/lists/lock. It is held by process N (apt-get)". This retries every 5 s for up to APT_LOCK_WAIT seconds
# (default 600), says once what it waits for, and gives up with a line that names the holder. Any other failure is
# apt-get's own, passed on at once with its exit status. DEBIAN_FRONTEND=noninteractive.
set -uo pipefail
limit=${APT_LOCK_WAIT:-600}
start=$(date +%s)
said=0
while :; do
  out=$(DEBIAN_FRONTEND=noninteractive apt-get "$@" 2>&1)
  rc=$?
  if [ $rc -eq 0 ]; then
    [ -n "$out" ] && printf '%s\n' "$out"
    exit 0
  fi
  lock=$(printf '%s\n' "$out" | grep -m1 -E "Could not get lock|Unable to acquire the dpkg frontend lock|Unable to lock")
  if [ -z "$lock" ]; then
    printf '%s\n' "$out" >&2
    exit $rc
  fi
  holder=$(printf '%s' "$lock" | grep -o "held by process [0-9]* ([^)]*)" || true)
  waited=$(( $(date +%s) - start ))
  if [ "$waited" -ge "$limit" ]; then
    echo "apt-get $*: another apt still holds its lock${holder:+ ($holder)} after ${waited}s; let it finish (or stop it), then run this again; APT_LOCK_WAIT sets the wait" >&2
    exit $rc
  fi
  if [ $said = 0 ]; then
    echo "apt-get $*: waiting for another apt to finish${holder:+ ($holder)}: up to ${limit}s (APT_LOCK_WAIT)" >&2
    said=1
  fi
  sleep "${APT_LOCK_POLL:-5}"
done
