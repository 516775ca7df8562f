#!/usr/bin/env bash
# Refuse a Python and framework combination that cannot install, before anything is installed (make deps runs this).
#
#   scripts/check_stack.sh PYTHON "FRAMEWORKS"
#
# Supported: Python 3.10-3.13 with PyTorch; MXNet 1.9.1 only up to Python 3.11, since it needs numpy < 1.24 (np.bool),
# and numpy 1.23 has no wheels for Python 3.12 or later. Exit 2 with one line naming the fix otherwise.
set -euo pipefail
py=${1:?usage: scripts/check_stack.sh PYTHON FRAMEWORKS}
frameworks=${2:-torch mxnet}
say() { echo "make install: $*" >&2; exit 2; }

command -v "$py" >/dev/null 2>&1 || say "PYTHON=$py was not found: name an interpreter on PATH or by its path (e.g. PYTHON=python3.11)"
version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || say "PYTHON=$py does not run: name a working interpreter (e.g. PYTHON=python3.11)"
minor=${version#3.}
case "$version" in 3.*) ;; *) say "PYTHON=$py is Python $version; hvdtrain needs Python 3.10-3.13" ;; esac
if [ "$minor" -lt 10 ] || [ "$minor" -gt 13 ]; then
  say "PYTHON=$py is Python $version; hvdtrain is supported on Python 3.10-3.13 (PyTorch) and 3.10-3.11 (MXNet)"
fi
for fw in $frameworks; do
  case "$fw" in
    torch) ;;
    mxnet) [ "$minor" -le 11 ] || say "FRAMEWORKS=\"$frameworks\" with Python $version: MXNet 1.9.1 needs numpy < 1.24, which has no wheels for Python $version; use FRAMEWORKS=torch with this Python, or PYTHON=python3.11 (or 3.10) for MXNet" ;;
    *) say "FRAMEWORKS: unknown framework '$fw' (torch, mxnet)" ;;
  esac
done
