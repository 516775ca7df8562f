import subprocess
import sys

from tests.helpers import ROOT


def run_py(code: str):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_import_hvdtrain_needs_neither_framework_nor_horovod():
    code = ("import sys\n"
            "for m in ('torch', 'mxnet', 'horovod'): sys.modules[m] = None\n"
            "import hvdtrain, hvdtrain.trainer, hvdtrain.cli, hvdtrain.callbacks, hvdtrain.checkpoint\n"
            "import recipes.mnist\n"
            "print('ok')\n")
    out = run_py(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_gluoncv_model_zoo_builds_resnet50_v1b_beside_torch():
    code = ("import torch\n"
            "from hvdtrain.backends.gluoncv_compat import import_gluoncv\n"
            "gcv = import_gluoncv()\n"
            "import sys\n"
            "assert sys.modules['torch'] is torch, 'torch must be restored'\n"
            "net = gcv.model_zoo.get_model('resnet50_v1b', pretrained=False)\n"
            "net.initialize()\n"
            "import mxnet as mx\n"
            "print(net(mx.nd.zeros((1, 3, 64, 64))).shape)\n")
    out = run_py(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(1, 1000)" in out.stdout


def test_the_installed_frameworks_import_from_bytecode():
    # make install writes the bytecode (Makefile: COMPILE). Where PYTHONDONTWRITEBYTECODE is set, Python would
    # otherwise compile each module from source in every process: every rank then paid about 8 s of CPU more for
    # torch and torch._dynamo (which the optimizer's first step imports) before its first step.
    import importlib.util
    import os
    missing = []
    for name in ("torch", "torch._dynamo", "mxnet", "horovod.torch", "horovod.mxnet", "numpy"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue  # a framework this install left out (FRAMEWORKS)
        if not os.path.exists(importlib.util.cache_from_source(spec.origin)):
            missing.append(name)
    assert not missing, f"no bytecode for {missing}: run make install (its compileall step)"


def test_doctor_warns_when_the_frameworks_would_be_compiled_in_every_process(tmp_path, monkeypatch):
    from hvdtrain.doctor import bytecode_row
    (tmp_path / "uncompiled_framework.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, what, value, fix = bytecode_row(("uncompiled_framework",), dont_write=True)
    assert status == "warn" and "uncompiled_framework not compiled" in value and "compileall" in fix
    assert bytecode_row(("uncompiled_framework",), dont_write=False)[0] == "ok"  # written at its first import
    assert bytecode_row(("torch", "mxnet"), dont_write=True)[0] == "ok", "make install compiles them"


def test_choosing_a_backend_freezes_the_frameworks_objects_out_of_the_collector():
    # Each full collection of a PyTorch rank otherwise walks every object torch's import left (0.2 s each here).
    code = ("import gc\n"
            "from hvdtrain.backends import backend_class\n"
            "backend_class('torch')\n"
            "print(gc.get_freeze_count(), len(gc.get_objects()))\n")
    out = run_py(code)
    assert out.returncode == 0, out.stderr[-3000:]
    frozen, unfrozen = map(int, out.stdout.split())
    assert frozen > 100_000 and unfrozen < frozen / 10, (frozen, unfrozen)


def test_mxnet_is_imported_without_scikit_learn_which_stays_importable():
    # MXNet 1.9.1's mx.model imports scikit-learn (and most of SciPy) for a legacy class: 0.4-0.8 s of CPU in every
    # MXNet process here. The backend's import hides it; the regression recipe and the data scripts still use it.
    code = ("import sys\n"
            "from hvdtrain.backends.gluoncv_compat import import_mxnet\n"
            "mx = import_mxnet()\n"
            "assert 'sklearn' not in sys.modules, 'scikit-learn was imported with mxnet'\n"
            "assert mx.model.BASE_ESTIMATOR is object\n"
            "assert import_mxnet() is mx\n"
            "from sklearn.datasets import load_diabetes\n"
            "assert load_diabetes(return_X_y=True)[0].shape == (442, 10)\n"
            "print('ok')\n")
    out = run_py(code)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_an_mxnet_run_leaves_scikit_learn_unimported(tmp_path):
    code = ("import sys\n"
            "from tests.tiny_recipe import TinyTrainer\n"
            f"TinyTrainer(framework='mxnet', epochs=1, output_dir={str(tmp_path)!r}).fit()\n"
            "print('sklearn' in sys.modules)\n")
    out = run_py(code)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "False", out.stdout[-2000:] + out.stderr[-3000:]


def _module_imports(package: str = "hvdtrain") -> dict:
    """{module: the modules of ``package`` (its subpackages included) it imports}, read from the source: relative and
    absolute imports, inside functions too; ``from . import x`` counts as x where x is a module."""
    import ast
    import os
    files = {}
    for dirpath, dirs, names in os.walk(os.path.join(ROOT, *package.split("."))):
        dirs[:] = [d for d in dirs if not d.startswith("__")]
        for name in names:
            if name.endswith(".py"):
                dotted = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].replace(os.sep, ".")
                files[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = \
                    os.path.join(dirpath, name)
    graph = {}
    for mod, path in files.items():
        here = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[mod] = {m for m in found if m in files and m != mod}
    return graph


def test_no_module_of_hvdtrain_imports_itself_in_a_circle():
    """config, guard and remote imported each other (ConfigError, is_url, job_label: in hvdtrain.basics now, below all
    of them), the trainer imported the package for its version, and bench/network.py and bench/project.py imported
    each other before. No module of hvdtrain, its backends and benchmarks included, reaches itself through its
    imports."""
    graph = _module_imports("hvdtrain")
    assert {"hvdtrain.config", "hvdtrain.bench.network", "hvdtrain.backends.torch"} <= set(graph)
    assert "hvdtrain.basics" in graph["hvdtrain.remote"] and "hvdtrain.config" in graph["hvdtrain.backends.base"]

    def reaches(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                return True
            if nxt not in seen:
                seen.add(nxt)
                if reaches(start, nxt, seen):
                    return True
        return False

    circles = [m for m in graph if reaches(m, m, set())]
    assert not circles, {m: graph[m] for m in circles}


def _top_level_imports(path: str) -> set:
    """The top-level names of the absolute imports in ``path`` (inside functions too)."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_layers_hold():
    """DESIGN.md's split, as imports: the loop knows no framework (of hvdtrain's own modules only backends/ and bench/
    import torch, mxnet, gluoncv or horovod, besides doctor.py and weights.py, which read the frameworks' builds and
    files, and raylaunch.py, a launcher that runs Horovod's rendezvous server as horovodrun does), a backend knows no recipe, a recipe knows no Horovod, and nothing the Trainer calls imports it back (only
    the package and the recipe registry do)."""
    import os
    frameworks = {"torch", "mxnet", "gluoncv", "horovod"}
    top = os.path.join(ROOT, "hvdtrain")
    knowing = {name: _top_level_imports(os.path.join(top, name)) & frameworks
               for name in os.listdir(top) if name.endswith(".py")}
    assert {name for name, used in knowing.items() if used} == {"doctor.py", "weights.py", "raylaunch.py"}, knowing
    for sub, forbidden in (("backends", {"recipes"}), (os.path.join("..", "recipes"), {"horovod"})):
        folder = os.path.join(top, sub)
        for name in os.listdir(folder):
            if name.endswith(".py"):
                assert not _top_level_imports(os.path.join(folder, name)) & forbidden, (sub, name)
    graph = _module_imports("hvdtrain")
    assert sorted(m for m, deps in graph.items() if "hvdtrain.trainer" in deps) == ["hvdtrain", "hvdtrain.registry"]
