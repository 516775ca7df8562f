#!/usr/bin/env bash
# The installed dependencies of a virtual environment, kept once per set of requirements, so that a second clone (a CI
# checkout, a worktree, a `make clean`) gets them in seconds instead of a pip install and a bytecode compile.
#
#   scripts/venv_cache.sh restore PYTHON VENV KEY   make VENV from the snapshot KEY; exit 1 (VENV untouched) if none
#   scripts/venv_cache.sh save VENV KEY             keep VENV's installed packages as the snapshot KEY
#
# KEY names everything that decides what is installed (make deps computes it: the Python, the pip command line, the
# text of setup.cfg, scripts/constraints.txt and this script, and pip's configuration). A snapshot is VENV's
# site-packages, bytecode included, with hvdtrain's own editable install left out, plus VENV/bin's scripts with their
# interpreter line replaced by a placeholder. Files are hard links into the snapshot (a copy where the cache is on another
# filesystem): pip replaces files, it never writes into one, so an install or an upgrade in a venv leaves the snapshot
# as it was. Restore makes a venv with PYTHON, links the snapshot in, writes the scripts for the new venv's python;
# make deps then installs hvdtrain itself (editable) into it.
#
# The cache is ${XDG_CACHE_HOME:-~/.cache}/hvdtrain/venvs/KEY (HVDTRAIN_VENV_CACHE overrides it; HVDTRAIN_VENV_CACHE=off
# turns it off); the 2 snapshots used last are kept.
set -euo pipefail

CACHE=${HVDTRAIN_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain/venvs}
[ "$CACHE" = off ] && exit 1
log() { echo "[venv_cache] $*" >&2; }
MARK='#!__HVDTRAIN_VENV_PYTHON__'

site_of() {  # the site-packages directory of the venv whose python is $1
  "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'
}

link_tree() {  # hard links where possible, else a copy
  cp -al "$1" "$2" 2>/dev/null || { rm -rf "$2"; cp -a "$1" "$2"; }
}

case "${1:-}" in
  restore)
    py=${2:?python}; venv=${3:?venv}; key=${4:?key}
    snap="$CACHE/$key"
    [ -f "$snap/complete" ] || exit 1
    [ -e "$venv" ] && { log "$venv exists: installing into it instead"; exit 1; }
    if ! { "$py" -m venv --without-pip "$venv" \
           && site=$(site_of "$venv/bin/python") && rm -rf "$site" && link_tree "$snap/site-packages" "$site"; }; then
      rm -rf "$venv"
      log "could not restore the snapshot $key: installing instead"
      exit 1
    fi
    bin=$(cd "$venv/bin" && pwd)
    for f in "$snap"/bin/*; do
      [ -e "$f" ] || continue  # an empty bin/
      name=$(basename "$f")
      if [ "$(head -c ${#MARK} "$f" | tr -d '\0')" = "$MARK" ]; then  # a binary's NUL bytes dropped, unwarned
        { echo "#!$bin/python"; tail -n +2 "$f"; } > "$bin/$name"
        chmod +x "$bin/$name"
      else
        cp -a "$f" "$bin/$name"
      fi
    done
    touch "$snap/complete"  # used last: kept by the pruning below
    log "restored the installed packages from the cache (snapshot ${key:0:12})"
    ;;
  save)
    venv=${2:?venv}; key=${3:?key}
    snap="$CACHE/$key"
    [ -f "$snap/complete" ] && exit 0
    mkdir -p "$CACHE"
    tmp=$(mktemp -d "$CACHE/.new-XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    link_tree "$(site_of "$venv/bin/python")" "$tmp/site-packages"
    rm -rf "$tmp"/site-packages/__editable__*hvdtrain* "$tmp"/site-packages/__editable___hvdtrain* \
      "$tmp"/site-packages/hvdtrain-*.dist-info
    mkdir "$tmp/bin"
    bin=$(cd "$venv/bin" && pwd)
    for f in "$bin"/*; do
      name=$(basename "$f")
      case "$name" in python*|activate*|Activate.ps1|hvdtrain) continue ;; esac
      [ -f "$f" ] && [ ! -L "$f" ] || continue
      if head -n1 "$f" | grep -qx "#!$bin/python[0-9.]*"; then
        { echo "$MARK"; tail -n +2 "$f"; } > "$tmp/bin/$name"
      else
        cp -a "$f" "$tmp/bin/$name"
      fi
    done
    touch "$tmp/complete"
    rm -rf "$snap"
    mv "$tmp" "$snap"
    trap - EXIT
    # keep the 2 snapshots used last
    ls -1dt "$CACHE"/*/complete 2>/dev/null | tail -n +3 | while read -r old; do rm -rf "$(dirname "$old")"; done
    log "kept the installed packages for the next install (snapshot ${key:0:12})"
    ;;
  *)
    echo "usage: scripts/venv_cache.sh restore PYTHON VENV KEY | save VENV KEY" >&2
    exit 2
    ;;
esac
