#!/usr/bin/env bash
# An hvdtrain recipe on every slot of a hostfile, launched by Open MPI's mpirun with the flags Horovod recommends.
#
#   scripts/cluster/mpirun.sh HOSTFILE NP RECIPE [--option value ...]
#   scripts/cluster/mpirun.sh scripts/cluster/hostfile.example 16 imagenet --framework mxnet --data-dir /data/imagenet
#
# Environment: IFACE, the network interface the hosts share (default eth0); PYTHON, the interpreter on every host
# (default python: activate the same virtualenv at the same path everywhere); MPIRUN_EXTRA, more mpirun options
# (e.g. "-mca plm_rsh_agent /path/to/ssh-wrapper").
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 HOSTFILE NP RECIPE [--option value ...]" >&2; exit 2; }
hostfile=$1 np=$2
shift 2
[ -r "$hostfile" ] || { echo "mpirun.sh: cannot read hostfile $hostfile" >&2; exit 2; }
iface=${IFACE:-eth0}
# -bind-to none -map-by slot: Horovod pins threads itself; pml ob1 + btl ^openib: plain TCP (no InfiniBand verbs
# stack needed); the if_include pair keeps MPI's data and control traffic on the shared interface; -x forwards the
# environment every rank needs (NCCL picks its interface from NCCL_SOCKET_IFNAME on GPU hosts).
# shellcheck disable=SC2086
exec mpirun -np "$np" --hostfile "$hostfile" \
  -bind-to none -map-by slot \
  -mca pml ob1 -mca btl ^openib \
  -mca btl_tcp_if_include "$iface" -mca oob_tcp_if_include "$iface" \
  -x PATH -x PYTHONPATH -x LD_LIBRARY_PATH -x NCCL_SOCKET_IFNAME="$iface" \
  ${MPIRUN_EXTRA:-} \
  "${PYTHON:-python}" -m hvdtrain recipe "$@"
