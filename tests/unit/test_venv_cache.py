"""scripts/venv_cache.sh, which gives a fresh clone's make install the packages a previous install kept: on small
venvs of a few files, since what it does to them does not depend on their size."""
import os
import subprocess

from tests.helpers import PY, ROOT, describe, run

SCRIPT = os.path.join(ROOT, "scripts", "venv_cache.sh")


def _venv(path):
    subprocess.run([PY, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return site


def _cache(tmp_path, *args):
    return run(["bash", SCRIPT, *map(str, args)], timeout=120, HVDTRAIN_VENV_CACHE=str(tmp_path / "cache"))


def test_a_restored_venv_links_the_packages_and_runs_its_scripts_with_its_own_python(tmp_path):
    first = tmp_path / "first" / ".venv"
    site = _venv(first)
    with open(os.path.join(site, "tinypkg.py"), "w") as f:
        f.write("VALUE = 42\n")
    for name in ("__editable__.hvdtrain-0.1.0.pth", "__editable___hvdtrain_0_1_0_finder.py"):
        open(os.path.join(site, name), "w").close()
    os.makedirs(os.path.join(site, "hvdtrain-0.1.0.dist-info"))
    tool = first / "bin" / "tinytool"
    tool.write_text(f"#!{first.resolve()}/bin/python\nimport sys, tinypkg\nprint(sys.prefix, tinypkg.VALUE)\n")
    tool.chmod(0o755)
    binary = first / "bin" / "tinybin"  # a compiled program (NUL bytes in its first ones) is copied as it is
    binary.write_bytes(b"\x7fELF\x00\x00\x00\x01" + bytes(range(256)))
    binary.chmod(0o755)

    saved = _cache(tmp_path, "save", first, "k1")
    assert saved.returncode == 0 and "kept the installed packages" in saved.stderr, describe(saved)

    second = tmp_path / "second" / ".venv"
    restored = _cache(tmp_path, "restore", PY, second, "k1")
    assert restored.returncode == 0 and "restored the installed packages" in restored.stderr, describe(restored)
    assert "null byte" not in restored.stderr, describe(restored)  # bash's warning on reading the binary
    assert (second / "bin" / "tinybin").read_bytes() == binary.read_bytes()
    out = subprocess.run([str(second / "bin" / "tinytool")], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [str(second.resolve()), "42"], out  # the new venv's python, the kept package
    site2 = subprocess.run([str(second / "bin" / "python"), "-c",
                            "import sysconfig; print(sysconfig.get_path('purelib'))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert os.stat(os.path.join(site2, "tinypkg.py")).st_ino == os.stat(os.path.join(site, "tinypkg.py")).st_ino
    assert not [n for n in os.listdir(site2) if "hvdtrain" in n], "hvdtrain's own install is made per clone"

    # a venv that exists is installed into, not replaced; an unknown key restores nothing
    assert _cache(tmp_path, "restore", PY, second, "k1").returncode == 1
    assert _cache(tmp_path, "restore", PY, tmp_path / "third", "nosuchkey").returncode == 1
    assert not (tmp_path / "third").exists()
    # the snapshot outlives the venv it came from
    subprocess.run(["rm", "-rf", str(first)], check=True)
    assert _cache(tmp_path, "restore", PY, tmp_path / "fourth", "k1").returncode == 0


def test_only_the_two_snapshots_used_last_are_kept(tmp_path):
    venv = tmp_path / ".venv"
    _venv(venv)
    for key in ("a", "b", "c"):
        assert _cache(tmp_path, "save", venv, key).returncode == 0
        os.utime(tmp_path / "cache" / key / "complete", (1e9 + ord(key), 1e9 + ord(key)))
    _cache(tmp_path, "save", venv, "d")
    assert sorted(os.listdir(tmp_path / "cache")) == ["c", "d"]
    off = run(["bash", SCRIPT, "restore", PY, str(tmp_path / "x"), "d"], timeout=60, HVDTRAIN_VENV_CACHE="off")
    assert off.returncode == 1 and not (tmp_path / "x").exists()


def test_a_cache_on_another_filesystem_is_copied_instead_of_linked(tmp_path):
    # cp -al fails across filesystems ("Invalid cross-device link"): a cp that refuses hard links stands in for that.
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "cp").write_text('#!/bin/sh\ncase "$1" in -al) echo "cp: cannot create hard link" >&2; exit 1;; esac\n'
                             'exec /bin/cp "$@"\n')
    (shim / "cp").chmod(0o755)
    first = tmp_path / "first" / ".venv"
    site = _venv(first)
    with open(os.path.join(site, "tinypkg.py"), "w") as f:
        f.write("VALUE = 7\n")
    no_links = {"HVDTRAIN_VENV_CACHE": str(tmp_path / "cache"), "PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}
    assert run(["bash", SCRIPT, "save", str(first), "k"], timeout=120, **no_links).returncode == 0
    second = tmp_path / "second" / ".venv"
    restored = run(["bash", SCRIPT, "restore", PY, str(second), "k"], timeout=120, **no_links)
    assert restored.returncode == 0, describe(restored)
    out = subprocess.run([str(second / "bin" / "python"), "-c", "import tinypkg, os; print(tinypkg.VALUE, "
                          "os.stat(tinypkg.__file__).st_ino)"], capture_output=True, text=True, timeout=60)
    value, inode = out.stdout.split()
    assert value == "7" and int(inode) != os.stat(os.path.join(site, "tinypkg.py")).st_ino, out
