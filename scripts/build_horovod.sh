#!/usr/bin/env bash
# Build (or reuse) the Horovod wheel for this virtual environment and install it.
#
#   scripts/build_horovod.sh PYTHON                 build or reuse, then install
#   scripts/build_horovod.sh PYTHON --print-key     print the wheel-cache key of this environment, build nothing
#
# Horovod 0.28.1 is built from the PyPI sdist against the frameworks already installed in PYTHON's environment
# (--no-build-isolation): PyTorch and MXNet by default, or those named by HVDTRAIN_FRAMEWORKS ("torch", "mxnet" or
# "torch mxnet"; make install FRAMEWORKS=...), with Gloo and, when Open MPI is found, MPI.
# Fixes, because 0.28.1 does not build as published against today's tools and has a crash:
#   1. CMake >= 4 rejects the bundled Gloo's cmake_minimum_required: we build with cmake < 4 (installed in the venv)
#      and also export CMAKE_POLICY_VERSION_MINIMUM=3.5 for hosts whose PATH offers a newer cmake first.
#   The others are applied to the unpacked sdist by scripts/patch_horovod.py (its header says why): C++17 for
#   torch >= 2.1 (horovod#3996), a use-after-free in the broadcast trace line that crashed MXNet jobs, the idle
#   wait, and a CPU build against a CUDA wheel of torch.
#
# GPU hosts (HOROVOD_GPU_OPERATIONS=NCCL): nvcc is taken from PATH, else from /usr/local/cuda (HOROVOD_CUDA_HOME);
# the CUDA architectures from the GPUs nvidia-smi lists (HOROVOD_BUILD_CUDA_CC_LIST, e.g. 90 for H100/H200: faster
# than every architecture nvcc knows, and immune to those a new CUDA dropped); NCCL from the nvidia-nccl wheel that
# CUDA builds of PyTorch install (HOROVOD_NCCL_HOME, linked shared), when the user names none.
#
# The wheel is cached in ${XDG_CACHE_HOME:-~/.cache}/hvdtrain/horovod/KEY/, where KEY covers everything the binary
# depends on: Horovod, torch, mxnet and Python versions, the frameworks built, the platform, every HOROVOD_* build
# variable (names and values, the derived GPU ones included), whether MPI was found (and its version), and the text of
# this script and of patch_horovod.py. A cached wheel is installed only when its recorded sha256 matches and the
# installed Horovod then reports the frameworks and controllers it was meant to have; otherwise the entry is removed
# and the wheel rebuilt.
#
# Environment: HOROVOD_* build variables pass through to the build. HVDTRAIN_WHEEL_CACHE overrides the cache
# directory; HVDTRAIN_NO_MPI=1 builds with Gloo only; HVDTRAIN_FRAMEWORKS chooses the frameworks;
# HVDTRAIN_HOROVOD_SDIST=horovod-0.28.1.tar.gz builds from that file instead of downloading it (hosts with no index);
# HVDTRAIN_HOROVOD_FIXES=1,4 builds in only those of patch_horovod.py's fixes (a stock Horovod, for the tests).
# A failed build prints the log's first error lines (scripts/build_log_excerpt.py) and keeps the whole log under the
# cache's logs/. Without HOROVOD_GPU_OPERATIONS the build is a CPU one whatever torch wheel (CUDA or CPU) is installed
# and whatever nvcc is on PATH (fix 4 in scripts/patch_horovod.py); with it, a CUDA toolkit without its runtime
# (cuda_runtime.h, libcudart) is refused before the build.
set -euo pipefail

PY=${1:?usage: scripts/build_horovod.sh PYTHON}
print_key=0
[ "${2:-}" = "--print-key" ] && print_key=1  # builds, installs and changes nothing: no apt-get, no links, no cache
HOROVOD_VERSION=0.28.1
FRAMEWORKS=${HVDTRAIN_FRAMEWORKS:-torch mxnet}
HERE=$(cd "$(dirname "$0")" && pwd)
CONSTRAINTS="$HERE/constraints.txt"
PIP=("$PY" -m pip --disable-pip-version-check)
log() { echo "[build_horovod] $*" >&2; }

# --- Open MPI ---------------------------------------------------------------------------------------------------
with_mpi=0
if [ "${HVDTRAIN_NO_MPI:-0}" != 1 ]; then
  if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1; then
    if [ $print_key = 1 ]; then
      :  # the key then says MPI is missing, as the build would find it without the install
    elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      log "Open MPI not found: installing openmpi-bin and libopenmpi-dev with apt-get"
      # another apt (a booting VM's unattended upgrades) may hold the lock: apt_get.sh waits for it, bounded
      bash "$(dirname "$0")/apt_get.sh" update -qq >&2
      bash "$(dirname "$0")/apt_get.sh" install -y -qq openmpi-bin libopenmpi-dev >&2
    else
      log "Open MPI not found; building Horovod with Gloo only (doctor will report MPI missing)."
      log "  To add MPI: sudo apt-get install openmpi-bin libopenmpi-dev (Debian/Ubuntu), then make install again."
    fi
  fi
  if command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; then
    with_mpi=1
  fi
fi
mpi_version=none
if [ $with_mpi = 1 ]; then
  mpi_version=$(mpirun --version 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9.\n' '_')
fi

for fw in $FRAMEWORKS; do
  case "$fw" in torch|mxnet) ;; *) log "HVDTRAIN_FRAMEWORKS: unknown framework '$fw' (torch, mxnet)"; exit 2 ;; esac
done

# --- GPU build environment ----------------------------------------------------------------------------------------
gpu_ops=${HOROVOD_GPU_OPERATIONS:-none}
if [ "$gpu_ops" != none ]; then
  if ! command -v nvcc >/dev/null 2>&1 && [ -z "${HOROVOD_CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export HOROVOD_CUDA_HOME=/usr/local/cuda
  fi
  if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
    ccs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd, -)
    [ -n "$ccs" ] && export HOROVOD_BUILD_CUDA_CC_LIST=$ccs
  fi
  if [ -z "${HOROVOD_NCCL_HOME:-}" ] && [ -z "${HOROVOD_NCCL_INCLUDE:-}" ]; then
    nccl_dir=$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
    if [ -n "$nccl_dir" ] && [ -f "$nccl_dir/include/nccl.h" ] && [ -f "$nccl_dir/lib/libnccl.so.2" ]; then
      # The wheel has libnccl.so.2 but no libnccl.so for the linker: a folder beside the cache gives it one.
      cache_dir=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/horovod}
      nccl_home="$cache_dir/nccl-$(sha256sum "$nccl_dir/lib/libnccl.so.2" | cut -c1-12)"
      if [ $print_key = 0 ]; then
        mkdir -p "$nccl_home/lib"
        ln -sfn "$nccl_dir/include" "$nccl_home/include"
        ln -sf "$nccl_dir/lib/libnccl.so.2" "$nccl_home/lib/libnccl.so"
        ln -sf "$nccl_dir/lib/libnccl.so.2" "$nccl_home/lib/libnccl.so.2"
      fi
      export HOROVOD_NCCL_HOME=$nccl_home HOROVOD_NCCL_LINK=SHARED
    fi
  fi
fi

# --- cache key --------------------------------------------------------------------------------------------------
versions=$("$PY" - <<'EOF'
import importlib.metadata as md, sys, sysconfig
def version(*names):
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            pass
    return "none"
print(version("torch"), version("mxnet", "mxnet-cu112", "mxnet-cu110", "mxnet-cu102"),
      "cp%d%d" % sys.version_info[:2], sysconfig.get_platform().replace("-", "_"))
EOF
)
read -r torch_v mxnet_v py_tag plat <<<"$versions"
for fw in $FRAMEWORKS; do
  v=$torch_v; [ "$fw" = mxnet ] && v=$mxnet_v
  [ "$v" != none ] || { log "$fw is not installed in $PY's environment: install it first (make deps)"; exit 2; }
done
script_hash=$(cat "$0" "$HERE/patch_horovod.py" | sha256sum | cut -c1-12)
fw_tag=$(echo $FRAMEWORKS | tr ' ' '+')
# Every HOROVOD_* variable the user set changes what is built (HOROVOD_GPU_OPERATIONS, HOROVOD_CUDA_HOME,
# HOROVOD_NCCL_HOME, HOROVOD_BUILD_CUDA_CC_LIST, HOROVOD_WITHOUT_GLOO, ...): all of them, names and values, are hashed
# into the key. They are read here, before this script exports its own.
build_env=$( { env | grep '^HOROVOD_' || true; } | LC_ALL=C sort | sha256sum | cut -c1-12)
# HVDTRAIN_HOROVOD_FIXES: which of scripts/patch_horovod.py's fixes to build in (default all; "1,4" builds what is
# needed to compile here and nothing else: a stock Horovod, for tests/e2e/test_foreign_horovod.py).
fixes=$(echo "${HVDTRAIN_HOROVOD_FIXES:-all}" | tr ',' '-')
key="horovod-${HOROVOD_VERSION}_${fw_tag}_torch-${torch_v}_mxnet-${mxnet_v}_${py_tag}_${plat}_gpu-${gpu_ops}_mpi-${with_mpi}-${mpi_version}_env-${build_env}_build-${script_hash}"
[ "$fixes" = all ] || key="${key}_fixes-${fixes}"
key=$(echo "$key" | tr '+/ ' '___')
if [ $print_key = 1 ]; then
  echo "$key"
  exit 0
fi
cache_root=${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/horovod}
entry="$cache_root/$key"

expected_frameworks=$FRAMEWORKS
expected_controllers="gloo"
[ $with_mpi = 1 ] && expected_controllers="gloo mpi"

verify_installed() {
  # Ask Horovod's own Python API what it was built with; exit non-zero when anything expected is missing.
  "$PY" - "$expected_frameworks" "$expected_controllers" <<'EOF'
import sys
import importlib
frameworks, controllers = sys.argv[1].split(), sys.argv[2].split()
# each import fails when that framework's extension is missing
hvd = [importlib.import_module(f"horovod.{fw}") for fw in frameworks][0]
built = {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built()}
missing = [c for c in controllers if not built[c]]
if missing:
    sys.exit("Horovod lacks: " + ", ".join(missing))
EOF
  # What horovodrun asks, in a process that has imported no framework (with fix 6 it loads the extension's library
  # alone, so that library must find torch's and MXNet's libraries by its own RUNPATH).
  "$PY" - "$expected_controllers" <<'EOF'
import sys
from horovod.common import util
built = {"gloo": util.gloo_built(), "mpi": util.mpi_built()}
missing = [c for c in sys.argv[1].split() if not built[c]]
if missing:
    sys.exit("horovodrun finds no " + ", ".join(missing) + " in this Horovod (horovod.common.util)")
EOF
}

installed_matches() {
  # The right wheel is already installed: nothing to do (make install is idempotent).
  [ -f "$entry/wheel.sha256" ] || return 1
  local recorded
  recorded=$("$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as md
d = md.distribution("horovod")
print((d.read_text("HVDTRAIN_BUILD_KEY") or "").strip())
EOF
) || return 1
  [ "$recorded" = "$key" ] && verify_installed 2>/dev/null
}

install_from_cache() {
  local whl
  whl=$(ls "$entry"/horovod-*.whl 2>/dev/null | head -n1) || true
  [ -n "$whl" ] && [ -f "$entry/wheel.sha256" ] || return 1
  if ! (cd "$entry" && sha256sum --quiet -c wheel.sha256 >/dev/null 2>&1); then
    log "cached wheel in $entry fails its checksum: discarding it"
    return 1
  fi
  "${PIP[@]}" install -q --no-deps --force-reinstall -c "$CONSTRAINTS" "$whl" >&2 || return 1
  # Horovod's own dependencies (cloudpickle, psutil, pyyaml, packaging, cffi) where the environment lacks them, as in
  # one that make deps did not fill; nothing already installed is replaced.
  "${PIP[@]}" install -q -c "$CONSTRAINTS" "$whl" >&2 || return 1
  verify_installed >&2 || { log "cached wheel does not import as expected: discarding it"; return 1; }
  return 0
}

if installed_matches; then
  log "Horovod $HOROVOD_VERSION already installed for this environment ($key)"
  exit 0
fi

if install_from_cache; then
  log "installed Horovod $HOROVOD_VERSION from the wheel cache ($entry)"
  exit 0
fi
rm -rf "$entry"

# --- build ------------------------------------------------------------------------------------------------------
# GPU operations need the CUDA toolkit's runtime (headers and libcudart), not only nvcc: say what is missing now,
# not after minutes of building. Without GPU operations nothing CUDA is built (fix 4), whatever torch or PATH hold.
check_cuda_toolkit() {
  local nvcc top missing=()
  if [ -n "${HOROVOD_CUDA_HOME:-}" ]; then nvcc="$HOROVOD_CUDA_HOME/bin/nvcc"; else nvcc=$(command -v nvcc || true); fi
  if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
    log "error: HOROVOD_GPU_OPERATIONS=$gpu_ops needs the CUDA toolkit, but no nvcc was found (PATH, HOROVOD_CUDA_HOME, /usr/local/cuda): install the toolkit or set HOROVOD_CUDA_HOME to its root; unset HOROVOD_GPU_OPERATIONS for a CPU build"
    exit 2
  fi
  # nvcc may be a wrapper script: its own dry run names the toolkit's root (TOP)
  local probe; probe=$(mktemp -d)
  : > "$probe/probe.cu"
  top=$("$nvcc" --dryrun -c "$probe/probe.cu" -o "$probe/probe.o" 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1 || true)
  rm -rf "$probe"
  [ -n "$top" ] || top=$(dirname "$(dirname "$nvcc")")
  compgen -G "$top/include/cuda_runtime.h" >/dev/null || compgen -G "$top/targets/*/include/cuda_runtime.h" >/dev/null \
    || missing+=("cuda_runtime.h (the runtime headers)")
  compgen -G "$top/lib64/libcudart*" >/dev/null || compgen -G "$top/lib/libcudart*" >/dev/null \
    || compgen -G "$top/targets/*/lib/libcudart*" >/dev/null || missing+=("libcudart (the runtime library)")
  if [ ${#missing[@]} -gt 0 ]; then
    log "error: HOROVOD_GPU_OPERATIONS=$gpu_ops needs the CUDA toolkit's runtime, but $(IFS=,; echo "${missing[*]}" | sed 's/,/ and /') is missing under $top (nvcc: $nvcc): install the toolkit's development files (e.g. cuda-cudart-dev) or set HOROVOD_CUDA_HOME to a complete toolkit; unset HOROVOD_GPU_OPERATIONS for a CPU build"
    exit 2
  fi
}
[ "$gpu_ops" = none ] || check_cuda_toolkit

log "building Horovod $HOROVOD_VERSION for $FRAMEWORKS (torch $torch_v, mxnet $mxnet_v, MPI: $with_mpi, GPU ops: $gpu_ops); about 5 minutes on 2 cores"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${HVDTRAIN_HOROVOD_SDIST:-}" ]; then  # a host without a package index (a GPU host, say): a carried sdist
  [ -f "$HVDTRAIN_HOROVOD_SDIST" ] || { log "HVDTRAIN_HOROVOD_SDIST=$HVDTRAIN_HOROVOD_SDIST does not exist"; exit 2; }
  cp "$HVDTRAIN_HOROVOD_SDIST" "$work/horovod-$HOROVOD_VERSION.tar.gz"
else
  "${PIP[@]}" download -q --no-deps --no-binary :all: -c "$CONSTRAINTS" "horovod==$HOROVOD_VERSION" -d "$work" >&2
fi
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
src="$work/horovod-$HOROVOD_VERSION"

# Fixes 2 and 3 (see scripts/patch_horovod.py).
"$PY" "$HERE/patch_horovod.py" "$src" >&2

# Fix 1: cmake < 4 from the venv first on PATH; the policy variable covers a newer one anyway.
venv_bin=$(dirname "$PY")
export PATH="$venv_bin:$PATH"
export CMAKE_POLICY_VERSION_MINIMUM=3.5
export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITH_GLOO=1
case " $FRAMEWORKS " in *" torch "*) export HOROVOD_WITH_PYTORCH=1 ;; *) export HOROVOD_WITHOUT_PYTORCH=1 ;; esac
case " $FRAMEWORKS " in *" mxnet "*) export HOROVOD_WITH_MXNET=1 ;; *) export HOROVOD_WITHOUT_MXNET=1 ;; esac
if [ $with_mpi = 1 ]; then export HOROVOD_WITH_MPI=1; else export HOROVOD_WITHOUT_MPI=1; fi
export MAKEFLAGS=${MAKEFLAGS:--j$(( $(nproc) + 1 ))}

"${PIP[@]}" wheel -v --no-deps --no-build-isolation -c "$CONSTRAINTS" -w "$work/dist" "$src" > "$work/build.log" 2>&1 || {
  # The cause is usually far above the tail (setuptools' clean-up ends the log): its first error lines first.
  mkdir -p "$cache_root/logs"
  kept="$cache_root/logs/build-$(date +%Y%m%d-%H%M%S)-${py_tag}.log"
  cp "$work/build.log" "$kept"
  "$PY" "$HERE/build_log_excerpt.py" "$work/build.log" >&2 || tail -n 60 "$work/build.log" >&2
  log "Horovod build failed; its first error lines are above, the whole log is in $kept"
  exit 1
}
whl=$(ls "$work"/dist/horovod-*.whl)
# The linker wrote into each extension library a RUNPATH that finds torch's and MXNet's libraries by the absolute
# path of this build's environment (.../site-packages/torch/lib). Installed from the cache into another environment
# (another clone, another venv) it would point at that one, or at nothing once it is gone, and horovodrun's "built
# with Gloo?" (fix 6 loads the library without its framework) would answer no. patchelf (installed here when the
# environment lacks it) rewrites those entries relative to the library ($ORIGIN/../../torch/lib); system entries
# (Open MPI's) stay as they are. Without patchelf the wheel keeps the absolute paths, and verify_installed discards
# it in an environment where they no longer lead anywhere.
patchelf=$(PATH="$venv_bin:$PATH" command -v patchelf || true)
if [ -z "$patchelf" ]; then
  "${PIP[@]}" install -q "patchelf>=0.17" >&2 || log "patchelf could not be installed: the wheel's RUNPATH stays absolute"
  patchelf=$(PATH="$venv_bin:$PATH" command -v patchelf || true)
fi
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
# The key travels inside the wheel's dist-info (readable through importlib.metadata), so an installed Horovod
# tells which build it is.
"$PY" - "$whl" "$key" "$site" "$patchelf" <<'EOF'
import base64, hashlib, os, subprocess, sys, tempfile, zipfile
whl, key, site, patchelf = sys.argv[1:5]


def relocated(name, content):
    """The library's RUNPATH with every entry inside the build's site-packages made relative to the library."""
    if not patchelf or not name.endswith(".so"):
        return content
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(content)
        f.flush()
        old = subprocess.run([patchelf, "--print-rpath", f.name], capture_output=True, text=True,
                             check=True).stdout.strip()
        here = os.path.dirname(os.path.join(site, name))
        inside = lambda p: os.path.isabs(p) and os.path.commonpath([os.path.realpath(p), os.path.realpath(site)]) \
            == os.path.realpath(site)
        new = ":".join("$ORIGIN/" + os.path.relpath(p, here) if inside(p) else p for p in old.split(":") if p)
        if new == old:
            return content
        subprocess.run([patchelf, "--set-rpath", new, f.name], check=True)
        print(f"[build_horovod] {name}: RUNPATH {new}", file=sys.stderr)
        with open(f.name, "rb") as g:
            return g.read()


def record_line(name, content):
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(content)}"


tmp = whl + ".tmp"
with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    distinfo = next(n.split("/")[0] for n in zin.namelist() if n.split("/")[0].endswith(".dist-info"))
    record = f"{distinfo}/RECORD"
    contents = {item.filename: relocated(item.filename, zin.read(item.filename)) for item in zin.infolist()}
    data = (key + "\n").encode()
    lines = []
    for line in contents[record].decode().splitlines():
        name = line.rsplit(",", 2)[0]
        lines.append(record_line(name, contents[name]) if name != record and name in contents else line)
    lines.append(record_line(f"{distinfo}/HVDTRAIN_BUILD_KEY", data))
    contents[record] = ("\n".join(lines) + "\n").encode()
    for item in zin.infolist():
        zout.writestr(item, contents[item.filename])
    zout.writestr(f"{distinfo}/HVDTRAIN_BUILD_KEY", data)
os.replace(tmp, whl)
EOF

mkdir -p "$entry.tmp"
cp "$whl" "$entry.tmp/"
(cd "$entry.tmp" && sha256sum "$(basename "$whl")" > wheel.sha256)
rm -rf "$entry"
mv "$entry.tmp" "$entry"
log "cached $(basename "$whl") in $entry"
install_from_cache || { log "the freshly built wheel does not import with PyTorch and MXNet"; exit 1; }
log "installed Horovod $HOROVOD_VERSION"
