#!/usr/bin/env bash
# Make Fashion-MNIST available: Debian's package dataset-fashion-mnist (60,000 training and 10,000 test images as IDX
# .gz files under /usr/share/datasets/fashion-mnist/), installed with apt-get when this is root on Debian or Ubuntu.
#
#   scripts/install_fashion_mnist.sh      exit 0: the files are there (already, or installed now); exit 1: they are
#                                         not, with one line saying why and what to do
set -uo pipefail
DIR=/usr/share/datasets/fashion-mnist
FILES="train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte"

present() {
  local f
  for f in $FILES; do [ -f "$DIR/$f.gz" ] || [ -f "$DIR/$f" ] || return 1; done
}

present && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "Fashion-MNIST is not installed in $DIR, and installing it needs root and apt-get:" \
       "sudo apt-get install dataset-fashion-mnist (or download the IDX files and pass --data-dir)" >&2
  exit 1
fi
echo "installing Fashion-MNIST: apt-get install dataset-fashion-mnist (30 MB)" >&2
apt="$(dirname "$0")/apt_get.sh"  # waits (bounded, said once) while another apt holds the lock
if ! bash "$apt" install -y -qq dataset-fashion-mnist >/dev/null 2>&1; then
  bash "$apt" update -qq >/dev/null
  bash "$apt" install -y -qq dataset-fashion-mnist >/dev/null || {
    echo "apt-get install dataset-fashion-mnist failed (is the package in this distribution's sources?)" >&2
    exit 1
  }
fi
present || { echo "dataset-fashion-mnist installed, but $DIR lacks the IDX files" >&2; exit 1; }
