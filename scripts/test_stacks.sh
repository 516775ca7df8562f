#!/usr/bin/env bash
# make test-stacks: install hvdtrain with each supported Python and train on 2 ranks with each.
#
#   scripts/test_stacks.sh [STACK ...]      STACK = PYTHON_VERSION:FRAMEWORKS, e.g. 3.12:torch or 3.10:torch+mxnet
#
# Default stacks: 3.10:torch+mxnet 3.12:torch 3.13:torch (3.11 is make install's own). Each gets its own virtual
# environment (.venv-stack-VERSION-FRAMEWORKS) through `make install PYTHON=... FRAMEWORKS=... VENV=...`, then one
# epoch of the MNIST recipe on the embedded digits on 2 ranks with horovodrun, per framework. The interpreter is
# python3.X on PATH, else pyenv's. One Horovod wheel cache serves every Python (its key holds the Python version).
# Each new Python costs a Horovod build (about 5 minutes on 2 cores) and, for PyTorch past 3.11 here, the download
# of PyTorch's default CUDA wheel (a few GB): not part of make test. Writes runs/stacks/matrix.md.
set -uo pipefail
cd "$(dirname "$0")/.."
stacks=("$@")
[ ${#stacks[@]} -gt 0 ] || stacks=(3.10:torch+mxnet 3.12:torch 3.13:torch)
out=runs/stacks
mkdir -p "$out"
rows=()
find_python() {
  local v=$1 p
  if p=$(command -v "python$v" 2>/dev/null) && "$p" -c 1 >/dev/null 2>&1; then echo "$p"; return 0; fi
  if command -v pyenv >/dev/null 2>&1; then
    for p in "$(pyenv root)"/versions/"$v".*/bin/"python$v"; do [ -x "$p" ] && { echo "$p"; return 0; }; done
  fi
  return 1
}
failed=0
for stack in "${stacks[@]}"; do
  version=${stack%%:*}
  frameworks=$(echo "${stack#*:}" | tr '+' ' ')
  venv=".venv-stack-$version-$(echo "$frameworks" | tr ' ' '+')"
  log="$out/$version-$(echo "$frameworks" | tr ' ' '+').log"
  if ! py=$(find_python "$version"); then
    rows+=("| $version | $frameworks | - | no python$version here | - |"); failed=1; continue
  fi
  echo "test-stacks: Python $version ($py), $frameworks: make install (log: $log)"
  start=$(date +%s)
  if ! make --no-print-directory install PYTHON="$py" FRAMEWORKS="$frameworks" VENV="$venv" > "$log" 2>&1; then
    rows+=("| $version | $frameworks | - | install failed: $(grep -m1 -E 'error|Error' "$log" | cut -c1-120) | - |")
    failed=1; continue
  fi
  installed=$(( $(date +%s) - start ))
  torch_v=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || echo -)
  data="$out/digits-$version"
  [ -f "$data/train-images-idx3-ubyte" ] || "$venv/bin/python" scripts/make_digits_mnist.py "$data" >> "$log" 2>&1
  for fw in $frameworks; do
    line=$(timeout 600 "$venv/bin/horovodrun" -np 2 -H localhost:2 --gloo "$venv/bin/python" -m hvdtrain recipe \
      mnist --framework "$fw" --epochs 1 --data-dir "$data" --output-dir "$out/run-$version-$fw" --resume never \
      2>>"$log" | tee -a "$log" | grep -o 'hvdtrain: done: .*after epoch 1' | tail -n1)
    if [ -n "$line" ]; then
      rows+=("| $version | $fw | $torch_v | ${line#hvdtrain: done: } | ${installed}s |")
    else
      rows+=("| $version | $fw | $torch_v | training failed (see $log) | ${installed}s |"); failed=1
    fi
  done
done
{
  echo "| Python | framework | torch | 1 epoch of MNIST on 2 ranks (horovodrun) | make install |"
  echo "| --- | --- | --- | --- | --- |"
  printf '%s\n' "${rows[@]}"
} | tee "$out/matrix.md"
exit $failed
