"""scripts/patch_horovod.py on a tree shaped like Horovod 0.28.1's (the texts it patches, verbatim)."""
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import patch_horovod  # noqa: E402

SCRIPT = os.path.join(ROOT, "scripts", "patch_horovod.py")


def fake_sdist(root):
    (root / "horovod" / "torch").mkdir(parents=True)
    (root / "horovod" / "common" / "gloo").mkdir(parents=True)
    (root / "horovod" / "common" / "ops").mkdir(parents=True)
    (root / "third_party" / "gloo" / "gloo" / "transport" / "tcp").mkdir(parents=True)
    for name in patch_horovod.CXX_FILES:
        (root / name).write_text(f"project(x)\n{patch_horovod.CXX14}\n")
    top = root / patch_horovod.CXX_FILES[0]
    top.write_text(top.read_text() + "".join(old for old, _new in patch_horovod.CUDA_LANGUAGE))
    sites = "\n".join(f"Status Enqueue{i}() {{\n{patch_horovod.TRACE_AFTER}  return status;\n}}" for i in range(3))
    sites += "\n" + patch_horovod.MARKER_AFTER
    texts = {patch_horovod.OPERATIONS: [sites]}
    for name, old, _new, _count in patch_horovod.IDLE_WAIT + patch_horovod.BLOCKING_WAIT + patch_horovod.BUILT_FLAGS \
            + patch_horovod.GLOO_RANKS + patch_horovod.GLOO_REDUCE_SCATTER + patch_horovod.GLOO_READ_LOW_WATER \
            + patch_horovod.TIMELINE_IDLE + patch_horovod.GLOO_BESIDE + patch_horovod.GLOO_EXCHANGE:
        texts.setdefault(name, []).append(old)
    texts[patch_horovod.FIND_PYTORCH] = ["find_package_handle_standard_args(Pytorch)", patch_horovod.CUDA_TEST,
                                         "if (Pytorch_CUDA OR Pytorch_ROCM)"]
    (root / "cmake" / "Modules").mkdir(parents=True)
    for name, parts in texts.items():
        (root / name).write_text("\n".join(parts))
    return root


def test_patches_apply_once_and_a_second_run_changes_nothing(tmp_path):
    src = fake_sdist(tmp_path / "horovod-0.28.1")
    first = subprocess.run([sys.executable, SCRIPT, str(src)], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert all(patch_horovod.CXX17 in (src / n).read_text() for n in patch_horovod.CXX_FILES)
    waits = (src / patch_horovod.TORCH_OPS).read_text()
    assert "handle_manager.WaitForHandle(handle)" in waits and "done_.notify_all()" in (
        src / patch_horovod.HANDLES_CC).read_text()
    ops = (src / patch_horovod.OPERATIONS).read_text()
    assert ops.count(patch_horovod.TRACE_BEFORE) == 3 and '"Enqueued "' not in ops
    assert ops.index('"Enqueueing "') < ops.index("AddToTensorQueue"), "the trace line comes before the queueing"
    queue_cc = (src / patch_horovod.QUEUE_CC).read_text()
    assert queue_cc.count("work_cv_.notify_one();") == 3, "both enqueues and Wake() notify the background thread"
    assert "IdleWaitMode()" in ops and "tensor_queue.Wake();" in ops
    find = (src / patch_horovod.FIND_PYTORCH).read_text()
    assert find.index("if(Pytorch_CUDA AND NOT HAVE_CUDA)") < find.index("if (Pytorch_CUDA OR Pytorch_ROCM)"), \
        "a CUDA torch counts as a CPU one, unless GPU operations were asked for, before the extension type is chosen"
    util = (src / patch_horovod.UTIL).read_text()
    assert "_extension_library(ext_base_name)" in util and "def _extension_library(" in util
    gloo = (src / patch_horovod.GLOO_CONTROLLER).read_text()
    assert "global_ranks_.resize(size_);" in gloo and "reserve" not in gloo.split("//")[0]
    rs = (src / patch_horovod.REDUCE_SCATTER).read_text()
    assert rs.index("distSendDataBufs_[i]->waitSend();") < rs.index(patch_horovod.DISTRIBUTION), \
        "the sends are waited for before the distribution phase writes into the buffer"
    pair = (src / patch_horovod.PAIR_CC).read_text()
    assert pair.index("static void SetReadLowWater(") < pair.index("// read is called from:") < \
        pair.index("SetReadLowWater(fd_, rcvlowat_, iov.iov_len);"), "a paused read waits for the rest of its part"
    assert "SetReadLowWater(fd_, rcvlowat_, 1);" in pair and "int rcvlowat_ = 1;" in (
        src / patch_horovod.PAIR_H).read_text(), "a part no buffer claimed yet wakes the reader at any byte"
    writer = (src / patch_horovod.TIMELINE_CC).read_text()
    assert "std::this_thread::yield();" not in writer and "sleep_for(std::chrono::milliseconds(5))" in writer, \
        "the timeline writer sleeps while its queue is empty"
    beside = (src / patch_horovod.GLOO_OPS_CC).read_text()
    assert "opts.setTag(tag);" in beside and beside.index("int64_t GlooAllreduce::BesideBytes(") < \
        beside.index("return ExecuteBeside(entries, glooOp,"), "a large allreduce runs beside, under its own tag"
    assert "  GlooAllreduceDrain();\n" in ops, "the shutdown waits for the allreduce beside"
    gloo = (src / patch_horovod.GLOO_CONTROLLER).read_text()
    assert gloo.count("ExchangeBits(gloo_context_.ctx, bitvector, count") == 2 and gloo.index("void ExchangeBits(") \
        < gloo.index("exchange_bits_ = off == 0") < gloo.index("if (exchange_bits_) {"), \
        "the negotiation's bit vectors are combined in one exchange, as the ranks agreed at initialization"
    assert "bool exchange_bits_ = false;" in (src / patch_horovod.GLOO_CONTROLLER_H).read_text()
    later = patch_horovod.IDLE_WAIT + patch_horovod.BLOCKING_WAIT + patch_horovod.BUILT_FLAGS + patch_horovod.GLOO_RANKS \
        + patch_horovod.GLOO_REDUCE_SCATTER + patch_horovod.GLOO_READ_LOW_WATER + patch_horovod.TIMELINE_IDLE \
        + patch_horovod.GLOO_BESIDE + patch_horovod.GLOO_EXCHANGE
    patched = {name: (src / name).read_text() for name in {n for n, *_ in later}}
    again = subprocess.run([sys.executable, SCRIPT, str(src)], capture_output=True, text=True, timeout=60)
    fixes = 5 + len(later) + len(patch_horovod.CUDA_LANGUAGE)  # the 4 below: C++17 (2 files), trace, find_pytorch
    assert 'const char* horovod_hvdtrain_fixes() { return "1,2,3,4,5,6,7,8,9,10,11,12"; }' in ops, \
        "the library names its fixes"
    top = (src / patch_horovod.CXX_FILES[0]).read_text()
    assert top.index(f"if({patch_horovod.GPU_ASKED})") < top.index("include(CheckLanguage)") < \
        top.index("endif()  # hvdtrain (fix 4)"), "no CUDA compiler is looked for unless GPU operations were asked for"
    assert again.returncode == 0 and again.stderr.count("already patched") == fixes, again.stderr
    assert all((src / name).read_text() == text for name, text in patched.items()), "a second run changed a file"


def test_a_tree_that_does_not_fit_is_refused_with_the_reason(tmp_path):
    src = fake_sdist(tmp_path / "horovod-0.29")
    ops = src / patch_horovod.OPERATIONS
    ops.write_text(ops.read_text().replace('"Enqueued "', '"Queued "', 1))  # one site changed upstream
    result = subprocess.run([sys.executable, SCRIPT, str(src)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "expected 3 occurrence(s)" in result.stderr and "0.28.1" in result.stderr
    with pytest.raises(patch_horovod.PatchError, match="not an unpacked Horovod source tree"):
        patch_horovod.patch(str(tmp_path / "empty"))


def test_a_build_only_tree_gets_what_it_needs_to_compile_and_no_marker(tmp_path):
    """--fixes 1,4 (the stock Horovod of tests/e2e/test_foreign_horovod.py): C++17 and the CPU build only; the library
    then has no horovod_hvdtrain_fixes(), as a stock one has none."""
    src = fake_sdist(tmp_path / "horovod-0.28.1")
    result = subprocess.run([sys.executable, SCRIPT, str(src), "--fixes", "1,4"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert all(patch_horovod.CXX17 in (src / n).read_text() for n in patch_horovod.CXX_FILES)
    ops = (src / patch_horovod.OPERATIONS).read_text()
    assert "horovod_hvdtrain_fixes" not in ops and '"Enqueued "' in ops, "fix 2 and the marker left out"
    patch_horovod.patch(str(src), [1, 4, 8])
    assert 'horovod_hvdtrain_fixes() { return "1,4,8"; }' in (src / patch_horovod.OPERATIONS).read_text()
    with pytest.raises(patch_horovod.PatchError, match="give fix numbers from 1 to 12"):
        patch_horovod.parse_fixes("1,13")
