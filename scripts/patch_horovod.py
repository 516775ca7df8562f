"""Apply hvdtrain's fixes to an unpacked Horovod 0.28.1 sdist (scripts/build_horovod.sh runs this before building).

    python scripts/patch_horovod.py SRC_DIR

1. C++17: torch >= 2.1 headers need it while 0.28.1 compiles as C++14 (horovod#3996, fixed upstream by PR #3998,
   never released): CMAKE_CXX_STANDARD 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt.
2. A crash: EnqueueTensorBroadcast (and Alltoall, Join) writes its trace line "Enqueued NAME" after handing the op
   to the background thread, and the stream insert runs at any log level. With horovod.mxnet NAME lives in the op's
   parameters, which the completion callback frees, so when the op completes first (at once with one rank) the log
   reads freed memory and the process segfaults: about 1 run in 20 of a small MXNet job. The line is written before
   the op is queued.

Each fix checks that its text is found exactly where expected and fails loudly otherwise; a tree already patched is
left as it is (running twice is harmless). Exit status 0 when the tree is patched, 1 with the reason otherwise.
"""
from __future__ import annotations

import os
import sys
from typing import List, Tuple

CXX14, CXX17 = "set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"
CXX_FILES = ("CMakeLists.txt", os.path.join("horovod", "torch", "CMakeLists.txt"))
OPERATIONS = os.path.join("horovod", "common", "operations.cc")
TRACE_AFTER = '''  Status status = process_set.tensor_queue.AddToTensorQueue(e, message);
  if (status.ok()) {
    LOG(TRACE, horovod_global.global_controller->GetRank())
        << "Enqueued " << name;
  }
'''
TRACE_BEFORE = '''  LOG(TRACE, horovod_global.global_controller->GetRank())
      << "Enqueueing " << name;
  Status status = process_set.tensor_queue.AddToTensorQueue(e, message);
'''
TRACE_SITES = 3  # broadcast, alltoall, join


class PatchError(RuntimeError):
    pass


def _replace(path: str, old: str, new: str, count: int) -> str:
    """Replace ``count`` occurrences of ``old`` in ``path``; 'patched' when only ``new`` is found ``count`` times."""
    with open(path) as f:
        text = f.read()
    found, done = text.count(old), text.count(new)
    if found == 0 and done >= count:
        return "already patched"
    if found != count:
        raise PatchError(f"{path}: expected {count} occurrence(s) of the text to patch, found {found}: "
                         f"is this Horovod 0.28.1?")
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return "patched"


def patch(src: str) -> List[Tuple[str, str]]:
    """Apply every fix under ``src``; returns (file, outcome) pairs; PatchError says what did not fit."""
    if not os.path.isfile(os.path.join(src, OPERATIONS)):
        raise PatchError(f"{src} is not an unpacked Horovod source tree (no {OPERATIONS})")
    done = [(name, _replace(os.path.join(src, name), CXX14, CXX17, 1)) for name in CXX_FILES]
    done.append((OPERATIONS, _replace(os.path.join(src, OPERATIONS), TRACE_AFTER, TRACE_BEFORE, TRACE_SITES)))
    return done


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python scripts/patch_horovod.py SRC_DIR", file=sys.stderr)
        return 2
    try:
        for name, outcome in patch(argv[0]):
            print(f"patch_horovod: {name}: {outcome}", file=sys.stderr)
    except (PatchError, OSError) as e:
        print(f"patch_horovod: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
