#!/usr/bin/env bash
# One prepared check of the GPU path on a GPU host, within about 8 minutes: build Horovod with NCCL against the
# PyTorch found there, run hvdtrain's doctor, then the ImageNet recipe (ResNet-50, synthetic data) at fp32, fp16 and
# bf16 beside a bare Horovod AMP loop, interleaved (python -m hvdtrain bench amp), and write one JSON of everything.
#
#   scripts/gpu_check.sh OUT_DIR                       the full check (needs a GPU, nvcc and the CUDA PyTorch)
#   scripts/gpu_check.sh OUT_DIR --cpu-smoke           no build (the installed Horovod), a tiny run on the CPU:
#                                                      what make test runs of this script
#
# The host needs no network: HVDTRAIN_HOROVOD_SDIST (default .gpu/horovod-0.28.1.tar.gz) is the Horovod sdist carried
# there, and hvdtrain itself is installed from this checkout without its dependencies (the host's PyTorch, numpy,
# tqdm, PyYAML, tensorboard and psutil serve). PYTHON (default python3) is the interpreter with the CUDA PyTorch; the
# full check installs into a virtual environment of its own on top of it (GPU_VENV, default .gpu/venv, made with
# --system-site-packages so the host's packages serve), never into that interpreter itself (PEP 668 refuses it, and
# an editable hvdtrain and a rebuilt Horovod would be left behind in it).
# Sizes: BATCH (128 per GPU), STEPS (50 per run, warm-up included), ROUNDS (2), PRECISIONS (fp32,fp16,bf16).
# OUT_DIR/gpu_check.json holds the build (seconds, wheel-cache key, log tail), the doctor's report and exit status, and
# bench amp's figures; OUT_DIR also keeps build.log, doctor.txt, amp.json and amp.png.
set -uo pipefail

out=${1:-}; mode=${2:-full}
[ -n "$out" ] || { echo "usage: scripts/gpu_check.sh OUT_DIR [--cpu-smoke]" >&2; exit 2; }
case "$mode" in full|--cpu-smoke) ;; *) echo "gpu_check: unknown option $mode (--cpu-smoke)" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "gpu_check: $PY not found (set PYTHON)" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$(date +%s)
log() { echo "gpu_check: [$(( $(date +%s) - start ))s] $*" >&2; }

build_rc=0; build_seconds=0; key=""
if [ "$mode" = full ]; then
  sdist=${HVDTRAIN_HOROVOD_SDIST:-.gpu/horovod-0.28.1.tar.gz}
  [ -f "$sdist" ] || { echo "gpu_check: no Horovod sdist at $sdist (carry horovod-0.28.1.tar.gz there, or set" \
                            "HVDTRAIN_HOROVOD_SDIST)" >&2; exit 2; }
  venv=${GPU_VENV:-.gpu/venv}
  if [ ! -x "$venv/bin/python" ]; then
    log "virtual environment $venv on top of $PY (the host's packages visible)"
    "$PY" -m venv --system-site-packages "$venv" || { echo "gpu_check: could not create $venv with $PY" >&2; exit 2; }
  fi
  PY=$venv/bin/python
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU visible to PyTorch'" \
    || { echo "gpu_check: PyTorch sees no GPU; on a CPU machine run it with --cpu-smoke" >&2; exit 2; }
  log "installing hvdtrain from this checkout into $venv (no dependencies: the host's serve)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
    || { tail -n 20 "$out/install.log" >&2; exit 1; }
  log "building Horovod with NCCL for PyTorch (scripts/build_horovod.sh)"
  export HVDTRAIN_FRAMEWORKS=torch HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS:-NCCL} HVDTRAIN_HOROVOD_SDIST=$sdist
  t0=$(date +%s)
  bash scripts/build_horovod.sh "$PY" >"$out/build.log" 2>&1; build_rc=$?
  build_seconds=$(( $(date +%s) - t0 ))
  key=$(bash scripts/build_horovod.sh "$PY" --print-key 2>/dev/null || true)
  log "build exit $build_rc after ${build_seconds}s"
fi

doctor_rc=0
if [ $build_rc = 0 ]; then
  log "python -m hvdtrain doctor"
  "$PY" -m hvdtrain doctor >"$out/doctor.txt" 2>&1; doctor_rc=$?
fi

amp_rc=1
if [ $build_rc = 0 ]; then
  if [ "$mode" = full ]; then
    sizes=(--model resnet50_v1b --image-size 224 --batch-size "${BATCH:-128}" --steps "${STEPS:-50}"
           --rounds "${ROUNDS:-2}" --precisions "${PRECISIONS:-fp32,fp16,bf16}")
  else
    sizes=(--model resnet18_v1b --image-size 32 --batch-size 4 --steps 2 --rounds 1 --precisions fp32)
  fi
  log "python -m hvdtrain bench amp ${sizes[*]}"
  "$PY" -m hvdtrain bench amp "${sizes[@]}" --output-dir "$out" >"$out/amp.log" 2>&1; amp_rc=$?
fi

compile_rc=1  # --compile against eager (issue 46): the GPU's side of docs/benchmarks.md's CPU figures
if [ $build_rc = 0 ] && [ "$mode" = full ]; then
  log "python -m hvdtrain bench compile --recipes imagenet --rounds ${ROUNDS:-2}"
  "$PY" -m hvdtrain bench compile --recipes imagenet --rounds "${ROUNDS:-2}" --output-dir "$out" \
    >"$out/compile.log" 2>&1; compile_rc=$?
fi

"$PY" - "$out" "$mode" "$build_rc" "$build_seconds" "$key" "$doctor_rc" "$amp_rc" "$(( $(date +%s) - start ))" \
  "$compile_rc" <<'PYEOF'
import json, os, sys
out, mode, build_rc, build_seconds, key, doctor_rc, amp_rc, seconds, compile_rc = sys.argv[1:]

def tail(name, n=40):
    path = os.path.join(out, name)
    return open(path).read().splitlines()[-n:] if os.path.exists(path) else []

amp = None
if os.path.exists(os.path.join(out, "amp.json")) and amp_rc == "0":
    with open(os.path.join(out, "amp.json")) as f:
        amp = json.load(f)
report = {"mode": "cpu-smoke" if mode == "--cpu-smoke" else "gpu", "seconds": int(seconds),
          "build": {"exit": int(build_rc), "seconds": int(build_seconds), "key": key, "log_tail": tail("build.log")},
          "doctor": {"exit": int(doctor_rc), "report": tail("doctor.txt", 60)},
          "amp": amp, "amp_exit": int(amp_rc), "amp_log_tail": [] if amp else tail("amp.log"),
          "compile_exit": int(compile_rc), "compile_log_tail": tail("compile.log")}
if compile_rc == "0" and os.path.exists(os.path.join(out, "compile.json")):
    with open(os.path.join(out, "compile.json")) as f:
        report["compile"] = json.load(f)
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(report, f, indent=2)
if amp:
    for precision, row in amp["precisions"].items():
        v = row["variants"]
        print(f"gpu_check: {precision}: hvdtrain {v['hvdtrain']['images_per_sec']:.1f} img/s, bare "
              f"{v['bare']['images_per_sec']:.1f} img/s, hvdtrain/bare {row['hvdtrain_over_bare']:.3f}")
print(f"gpu_check: wrote {out}/gpu_check.json")
sys.exit(0 if int(build_rc) == 0 and amp is not None else 1)
PYEOF
