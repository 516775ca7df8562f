"""scripts/build_horovod.sh decisions that take seconds, not a 5-minute build: the CUDA toolkit check, a --print-key
that changes nothing, the error excerpt of a failed build's log, and the Pythons make install accepts. (That a CPU
build ignores a CUDA torch and an nvcc on PATH is fix 4 of scripts/patch_horovod.py, tested on its text in
test_horovod_patch.py and by make test-stacks, whose Pythons past 3.11 get PyTorch's CUDA wheel.)"""
import os
import shutil
import subprocess
import sys

from tests.helpers import PY, ROOT, describe, run

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import build_log_excerpt  # noqa: E402

BUILD = os.path.join(ROOT, "scripts", "build_horovod.sh")


def _fake_nvcc(bin_dir):
    """An nvcc that exists and answers, as on a host with the compiler but without the CUDA runtime."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver (fake)'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_gpu_operations_without_the_cuda_runtime_are_refused_before_building(tmp_path):
    _fake_nvcc(tmp_path / "cuda" / "bin")
    r = run(["bash", BUILD, PY], timeout=120, HOROVOD_GPU_OPERATIONS="NCCL", HVDTRAIN_WHEEL_CACHE=str(tmp_path / "c"),
            PATH=f"{tmp_path / 'cuda' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert r.returncode == 2, describe(r)
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "needs the CUDA toolkit's runtime, but cuda_runtime.h (the runtime headers) and " \
        f"libcudart (the runtime library) is missing under {tmp_path / 'cuda'}" in errors[0], describe(r)
    assert "building Horovod" not in r.stderr


def test_print_key_installs_links_and_caches_nothing(tmp_path):
    # A PATH without MPI (the script would apt-get it as root) and a CUDA torch's NCCL wheel (it would link it).
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("dirname", "id", "head", "tr", "cut", "sha256sum", "cat", "sort", "env", "grep", "paste", "mkdir",
                 "ln", "sed", "rm", "mktemp", "date", "cp"):
        os.symlink(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip(),
                   fake / tool)
    calls = tmp_path / "apt-calls"
    (fake / "apt-get").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (fake / "apt-get").chmod(0o755)
    nccl = tmp_path / "site" / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    (tmp_path / "site" / "nvidia" / "__init__.py").write_text("")
    (nccl / "__init__.py").write_text("")
    cache = tmp_path / "cache"
    r = run([shutil.which("bash"), BUILD, PY, "--print-key"], timeout=120, PATH=str(fake), HVDTRAIN_WHEEL_CACHE=str(cache),
            HOROVOD_GPU_OPERATIONS="NCCL", PYTHONPATH=str(tmp_path / "site"))
    assert r.returncode == 0 and r.stdout.strip().startswith("horovod-0.28.1_"), describe(r)
    assert "_mpi-0-none_" in r.stdout and "_gpu-NCCL_" in r.stdout
    assert not calls.exists(), calls.read_text()
    assert not cache.exists(), list(cache.rglob("*"))


CMAKE_FAILURE = (["-- Found Pytorch: 2.13.0+cu130 (found suitable version \"2.13.0+cu130\", minimum required is "
                  "\"1.5.0\")"] + [f"  building object {i}" for i in range(300)] +
                 ["CMake Error at /usr/share/cmake-3.25/Modules/FindPackageHandleStandardArgs.cmake:230 (message):",
                  "  Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART) (found",
                  "  version \"13.0.88\")", "Call Stack (most recent call first):", "  horovod/torch/CMakeLists.txt:23",
                  "", "-- Configuring incomplete, errors occurred!"] +
                 [f"  removing build/temp/{i}" for i in range(80)] +
                 ["Traceback (most recent call last):", "  File \"setup.py\", line 1, in <module>",
                  "subprocess.CalledProcessError: Command '['cmake', ...]' returned non-zero exit status 1."])


def test_a_failed_build_shows_its_first_error_lines_not_only_the_tail(tmp_path):
    log = tmp_path / "build.log"
    log.write_text("\n".join(CMAKE_FAILURE))
    r = subprocess.run([sys.executable, build_log_excerpt.__file__, str(log)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].startswith("302: CMake Error at") and "Could NOT find CUDAToolkit (missing: " \
        "CUDAToolkit_INCLUDE_DIR CUDA_CUDART)" in r.stdout, r.stdout
    assert "CalledProcessError" in lines[-1] and len(lines) < 30, r.stdout
    log.write_text("all good\n" * 50)
    assert subprocess.run([sys.executable, build_log_excerpt.__file__, str(log)], timeout=60).returncode == 1


def _fake_python(tmp_path, version):
    """An interpreter that says it is Python ``version`` (the check asks nothing else)."""
    py = tmp_path / f"python{version}"
    py.write_text(f"#!/bin/sh\necho {version}\n")
    py.chmod(0o755)
    return str(py)


def test_mxnet_on_a_python_without_numpy_1_23_wheels_is_refused_before_anything_installs(tmp_path):
    venv = tmp_path / "venv"
    r = run(["make", "--no-print-directory", "install", f"PYTHON={_fake_python(tmp_path, '3.12')}",
             f"VENV={venv}"], timeout=120)
    assert r.returncode != 0 and not venv.exists(), describe(r)
    assert ('make install: FRAMEWORKS="torch mxnet" with Python 3.12: MXNet 1.9.1 needs numpy < 1.24, which has no '
            'wheels for Python 3.12; use FRAMEWORKS=torch with this Python, or PYTHON=python3.11 (or 3.10) for MXNet'
            in r.stderr), describe(r)


def test_the_supported_pythons_and_frameworks(tmp_path):
    check = os.path.join(ROOT, "scripts", "check_stack.sh")

    def verdict(version, frameworks):
        return subprocess.run(["bash", check, _fake_python(tmp_path, version), frameworks], capture_output=True,
                              text=True, timeout=60)

    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert verdict(version, "torch").returncode == 0, version
    assert verdict("3.10", "torch mxnet").returncode == 0 and verdict("3.11", "mxnet").returncode == 0
    assert verdict("3.13", "mxnet").returncode == 2
    old = verdict("3.9", "torch")
    assert old.returncode == 2 and "supported on Python 3.10-3.13" in old.stderr


def test_the_installed_horovod_finds_its_frameworks_libraries_relative_to_itself_in_any_environment():
    """The cached wheel is installed into every clone's venv: a RUNPATH naming the venv it was built in leads to
    nothing once that venv is gone, and horovodrun (fix 6 loads the extension's library without its framework) then
    says Gloo was not built. Every RUNPATH entry inside a Python environment is relative ($ORIGIN/...)."""
    assert shutil.which("readelf"), "readelf (binutils, which the Horovod build needs) is missing"
    import horovod
    libs = [os.path.join(d, f) for d, _, files in os.walk(os.path.dirname(horovod.__file__)) for f in files
            if f.endswith(".so")]
    assert libs
    for lib in libs:
        dynamic = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
        paths = [p for line in dynamic.splitlines() if "(RUNPATH)" in line or "(RPATH)" in line
                 for p in line.split("[", 1)[1].rstrip("]").split(":")]
        assert not [p for p in paths if p.startswith("/") and "site-packages" in p], (lib, paths)
    r = run([PY, "-c", "from horovod.common import util; import sys; print(util.gloo_built(), "
                       "'torch' in sys.modules, 'mxnet' in sys.modules)"], timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-3:] == ["True", "False", "False"], describe(r)
