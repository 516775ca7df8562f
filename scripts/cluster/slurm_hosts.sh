#!/usr/bin/env bash
# Inside a Slurm allocation (salloc or sbatch), print the allocation as horovodrun's -H list: host0:2,host1:2,...
# The hosts come from `scontrol show hostnames $SLURM_JOB_NODELIST`, the slots from SLURM_TASKS_PER_NODE
# (Slurm's compressed form, e.g. "2(x3),1": 2 tasks on each of the first 3 nodes, 1 on the fourth).
#
#   salloc -N 2 --ntasks-per-node=4 bash -c \
#     'horovodrun -np $SLURM_NTASKS -H $(scripts/cluster/slurm_hosts.sh) python -m hvdtrain recipe mnist ...'
set -euo pipefail
[ -n "${SLURM_JOB_NODELIST:-}" ] || { echo "slurm_hosts: not inside a Slurm allocation (no SLURM_JOB_NODELIST)" >&2; exit 2; }
mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
slots=()
IFS=, read -ra groups <<< "${SLURM_TASKS_PER_NODE:-1}"
for g in "${groups[@]}"; do
  if [[ $g =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
    for ((i = 0; i < BASH_REMATCH[2]; i++)); do slots+=("${BASH_REMATCH[1]}"); done
  else
    slots+=("$g")
  fi
done
[ ${#slots[@]} -eq ${#hosts[@]} ] || {
  echo "slurm_hosts: ${#hosts[@]} nodes but SLURM_TASKS_PER_NODE=${SLURM_TASKS_PER_NODE:-} lists ${#slots[@]}" >&2
  exit 2
}
out=()
for i in "${!hosts[@]}"; do out+=("${hosts[$i]}:${slots[$i]}"); done
(IFS=,; echo "${out[*]}")
