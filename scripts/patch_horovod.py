"""Apply hvdtrain's fixes to an unpacked Horovod 0.28.1 sdist (scripts/build_horovod.sh runs this before building).

    python scripts/patch_horovod.py SRC_DIR

1. C++17: torch >= 2.1 headers need it while 0.28.1 compiles as C++14 (horovod#3996, fixed upstream by PR #3998,
   never released): CMAKE_CXX_STANDARD 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt.
2. A crash: EnqueueTensorBroadcast (and Alltoall, Join) writes its trace line "Enqueued NAME" after handing the op
   to the background thread, and the stream insert runs at any log level. With horovod.mxnet NAME lives in the op's
   parameters, which the completion callback frees, so when the op completes first (at once with one rank) the log
   reads freed memory and the process segfaults: about 1 run in 20 of a small MXNet job. The line is written before
   the op is queued.
3. An idle background thread that costs a core's share: every HOROVOD_CYCLE_TIME (1 ms) the background thread of
   every rank runs a negotiation round (a collective) whether or not a tensor is queued. With two ranks on two cores
   that round competes with the compute all through the forward and backward passes. With HOROVOD_IDLE_WAIT set, a
   rank with nothing queued and nothing in flight waits on a condition variable that the enqueue notifies (at most
   50 ms, so shutdown, stall checks and a dead peer are still seen); HOROVOD_IDLE_WAIT=1 then lets one cycle pass
   from the first tensor queued (the tensors of the rest of the backward pass join the same fused response),
   HOROVOD_IDLE_WAIT=2 negotiates at once. Unset or 0 is Horovod's own loop. Only with a single process set and no
   dynamic process sets (a rank waiting here takes part in no collective, so every set would have to be idle).

4. A CPU host that got PyTorch's default (CUDA) wheel: FindPytorch.cmake takes torch for a CUDA build when torch was
   built with CUDA and torch finds a CUDA_HOME (any nvcc on PATH, or /usr/local/cuda), and horovod/torch then asks
   for the whole CUDA toolkit ("Could NOT find CUDAToolkit (missing: CUDAToolkit_INCLUDE_DIR CUDA_CUDART)" where
   only nvcc is installed). Horovod's GPU support is asked for with HOROVOD_GPU_OPERATIONS (or HOROVOD_GPU_ALLREDUCE,
   ...), which makes the top-level CMakeLists set HAVE_CUDA / HAVE_ROCM; without them the torch extension is built
   as a CPU extension (CppExtension flags, no CUDA kernels), which a CUDA build of torch loads and runs on the CPU.
   And the top-level CMakeLists looks for a CUDA compiler only then: an nvcc on PATH without the toolkit's runtime
   otherwise fails enable_language(CUDA) ("Couldn't find CUDA library root") in a build that compiles no CUDA.

5. A PyTorch rank that waits for a collective by spinning: horovod.torch's WaitAndClear (hvd.synchronize, and so
   DistributedOptimizer.synchronize) polls the op's handle in a loop, releasing and retaking the GIL and yielding
   between polls, so the waiting thread keeps a core busy for as long as the collective takes. Under a container's
   CPU quota that core's share is what Horovod's background thread needs to move the bytes (measured: one 6.5 MB
   allreduce 4.5x slower through horovod.torch than through horovod.mxnet at 0.4 cores per host). The handle
   manager gets a condition variable that MarkDone (and Reset) notifies, and WaitAndClear sleeps on it with the GIL
   released once: no spinning, and no fixed sleep to add latency (the wake-up is the op's completion itself).
   HOROVOD_SPIN_WAIT=1 restores the loop (read at each wait): where a rank has whole cores of its own, spinning
   measured faster (the wake-up of a blocked thread costs more than the spin), so hvdtrain chooses per rank.

6. A launcher that imports a framework to learn what was built: horovodrun (gloo_built, mpi_built, nccl_built, ...
   in horovod/common/util.py) forks a process that imports horovod.tensorflow, then horovod.torch, then
   horovod.mxnet, each with its framework, and asks the first that imports. That costs every horovodrun the import
   of PyTorch (about 4.4 s of CPU, measured: 5.8 s of CPU for horovodrun of a command that does nothing, 1.4 s after
   the fix), taken from the ranks it starts on the same host. What a build holds is compiled into the extension's
   library: the "built with" checks now load the library alone (ctypes, in the same forked process) and ask it; an
   extension whose library is missing counts as not built, as its import would; "is the framework importable"
   (extension_available) and "is there a GPU" (gpu_available) still import.

7. A stall that is never reported under Gloo: GlooController::Initialize fills its list of the process set's
   global ranks with reserve() and an allgather into data(), so the list keeps size 0, and the stall inspector, which
   walks the ranks of that list (CheckForStalledTensors), never finds a rank missing. A rank that stops submitting
   tensors while alive (blocked in its own code, its data) is then neither warned about after
   HOROVOD_STALL_CHECK_TIME_SECONDS nor shut down after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS, and the job waits
   forever (measured: 2 ranks, one sleeping 40 s before an allreduce with 5 s / 10 s set, no warning, no shutdown;
   the MPI controller sizes the list and reports it). The list is resized instead.

8. Wrong results from hvd.reducescatter under Gloo: gloo::ReduceScatterHalvingDoubling (third_party/gloo, what
   GlooReducescatter runs) posts its sends, and in its distribution phase moves this rank's part to the front of the
   same buffer without waiting for them: the bytes the transport had not yet written reach the peer overwritten.
   With two ranks, rank 1 overwrites what it still sends to rank 0, so the tail of rank 0's part comes back wrong
   (measured: 4.5 M of 8 M elements wrong every time when host1 sends at 100 Mbit/s and host0 at full speed; on one
   loaded machine about one round in 30 of 11 M elements, enough that a --shard-optimizer run of a ResNet-18 took a
   different first step now and then). The distribution phase now waits for every send it posted (waitSend) before
   it writes into the buffer.

9. A transport thread that wakes for every packet: Gloo's TCP pair (third_party/gloo, gloo/transport/tcp/pair.cc)
   reads in the device thread whenever epoll says its socket is readable, which is as soon as one segment has arrived.
   A link that delivers its packets spread out (a shaped or slow link: 200 Mbit/s is a 1.5 KB packet every 60 us)
   wakes that thread once or twice per packet for the whole of a large message, and every wake-up costs CPU
   (measured: 3,700 wake-ups and 56 ms of the transport thread's CPU per step for 6.5 MB of gradients at 2 hosts,
   about 15 us each; under a CPU quota of a quarter core that is most of the step's spare CPU). When a read stops
   mid-message for want of bytes, the pair now sets SO_RCVLOWAT to what is left of the part it is reading (the
   preamble or the payload), at most HOROVOD_GLOO_RCVLOWAT bytes (default 32768; 0 turns it off, Gloo's own reads):
   the kernel then wakes the thread when that much has arrived, or sooner when its receive window runs short. The
   bytes waited for are always on their way (the peer is writing that message), so no read waits for bytes that
   will not come; a part not yet claimed by a buffer (which Gloo leaves for a later wake-up) sets it back to 1.

10. A timeline writer that spins for the whole job: with HOROVOD_TIMELINE set (hvdtrain's --timeline-steps sets it to
   DYNAMIC at start-up, so that the window can start later) Horovod's TimelineWriter::WriterLoop drains its queue and
   then calls std::this_thread::yield() in a loop, recording or not: a thread that takes all the CPU the scheduler
   gives it. On a host with cores to spare that is a core; under a CPU quota it is the quota's share that the
   training and Horovod's own threads needed (measured: 2 shaped hosts at a quarter core each trained 21 img/s
   instead of 143 from the first step, long before the window). With nothing queued the writer now sleeps 5 ms
   between looks (a pending start or stop of the timeline waits that long at most; the queue holds a million
   records, far more than 5 ms of any job writes).

11. A small allreduce held behind a large one: Horovod's background thread runs one collective at a time, so a group
   of gradients queued while a large one is on the wire (the convolutions' group, ready a few ms into the output
   layers' 300 ms over a shaped link) is negotiated and reduced only after it, and holds the next step back by the
   negotiation and its own transfer (measured: 8-9 ms of a 317 ms step at 2 hosts, where c10d's process group, a
   pool of threads with a tag per collective, reduces DDP's second bucket beside its first). With
   HOROVOD_GLOO_ASYNC_BYTES=N an allreduce of at least N bytes on the global process set (CPU tensors, Gloo) runs
   on a thread of its own ("hvd beside"), under a Gloo tag of its own on the same context (Gloo matches messages by
   slot, and its allreduce documents the tag as what tells parallel operations apart), and the background thread goes
   on negotiating and running what is queued behind it. One such allreduce is in flight at a time: the next waits for
   it. The ranks cannot deadlock on it: every rank performs the same responses in the same order, so by the time any
   rank's background thread completes a collective after the large one, every rank has started the large one, and
   the large one needs nothing from the background threads; a rank waiting for the previous large one waits for an
   operation every rank has started. Whether it is on is agreed by the ranks (the smallest value of the variable, by
   an allreduce of the first allreduce each rank runs on the global set), so a variable set on some hosts only
   cannot split them; the shutdown waits for the one in flight.

12. A negotiation round that takes a wake-up per rank in a row: every round of Horovod's negotiation combines the
   ranks' bit vectors (the response cache's hits, and its invalid entries when there are any) with Gloo's allreduce,
   a ring that passes a vector of a few bytes from rank to rank, 2 (ranks - 1) hops in a row, each waiting for the
   next rank's background thread to run. On a host whose cores are busy or rationed, each hop waits for that
   thread's turn (measured: 4 hosts of half a core, the first gradient group, queued 8 ms into the backward pass,
   went on the wire a median 18 ms after the last rank queued it, 12.8 ms with this fix; DDP's leaves at once). The
   vectors are now combined in one exchange: every rank sends its vector to every other (Gloo's alltoall, under a
   tag of its own) and combines what it receives, so a round waits for the slowest rank once. AND and OR are exact in any order,
   so every rank decides what the ring decided. Up to 16 ranks in a process set (each sends 15 vectors of a few bytes
   a round); beyond that, the ring as before. The ranks agree on it when the controller starts (an allreduce):
   HOROVOD_GLOO_RING_NEGOTIATION=1 on any rank gives all of them the ring, so a variable set on some hosts only
   cannot split them. Every rank of a job must have the fix (as with every build difference: a rank without it does
   not take part in that allreduce, and the job fails after Gloo's timeout).

Each fix checks that its text is found exactly where expected and fails loudly otherwise; a tree already patched is
left as it is (running twice is harmless). Exit status 0 when the tree is patched, 1 with the reason otherwise.

A library built with any of fixes 2, 3 and 5-12 says which: the patch adds ``horovod_hvdtrain_fixes()`` to the
library's C interface (beside ``horovod_gloo_built()``), returning their numbers ("1,2,...,12"), which
hvdtrain.horovod_fixes reads through ctypes. A build with only what it needs to compile (fixes 1 and 4, ``--fixes
1,4``: a stock Horovod for the tests) has no such function, as a stock or other build has none.

    python scripts/patch_horovod.py SRC_DIR [--fixes 1,4]   (default: every fix; HVDTRAIN_HOROVOD_FIXES too)
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

QUEUE_H = os.path.join("horovod", "common", "tensor_queue.h")
QUEUE_CC = os.path.join("horovod", "common", "tensor_queue.cc")
# (file, old, new, count) for fix 3.
IDLE_WAIT = [
    (QUEUE_H, "#include <mutex>\n", "#include <chrono>\n#include <condition_variable>\n#include <mutex>\n", 1),
    (QUEUE_H, "  void RemoveJoinTensor();\n", """  void RemoveJoinTensor();

  // hvdtrain: block until a message is queued, a tensor is in flight, Wake() is called or timeout passes;
  // true when it waited (the queue was idle).
  bool WaitForWork(std::chrono::steady_clock::duration timeout);

  void Wake();
""", 1),
    (QUEUE_H, "  mutable std::mutex mutex_;\n", """  mutable std::mutex mutex_;

  std::condition_variable work_cv_;
  bool wake_ = false;
""", 1),
    (QUEUE_CC, "  message_queue_.push(std::move(message));\n  return Status::OK();\n",
     "  message_queue_.push(std::move(message));\n  work_cv_.notify_one();\n  return Status::OK();\n", 1),
    (QUEUE_CC, "    message_queue_.push(std::move(messages[i]));\n  }\n  return Status::OK();\n",
     "    message_queue_.push(std::move(messages[i]));\n  }\n  work_cv_.notify_one();\n  return Status::OK();\n", 1),
    (QUEUE_CC, "// Remove JoinOp tensor from the table and execute the callback\n", """bool TensorQueue::WaitForWork(std::chrono::steady_clock::duration timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto ready = [this] { return wake_ || !message_queue_.empty() || !tensor_table_.empty(); };
  bool waited = !ready();
  if (waited) {
    work_cv_.wait_for(lock, timeout, ready);
  }
  wake_ = false;
  return waited;
}

void TensorQueue::Wake() {
  std::lock_guard<std::mutex> guard(mutex_);
  wake_ = true;
  work_cv_.notify_one();
}

// Remove JoinOp tensor from the table and execute the callback
""", 1),
    (OPERATIONS, """bool RunLoopOnce(HorovodGlobalState& state) {
  // This delay determines thread frequency and communication message latency
  auto start_time = std::chrono::steady_clock::now();
""", """// hvdtrain: HOROVOD_IDLE_WAIT (0: cycle while idle, Horovod's loop; 1: wait for work, then one cycle time;
// 2: wait for work, then negotiate at once), read once.
static int IdleWaitMode() {
  static const int mode = [] {
    const char* value = std::getenv("HOROVOD_IDLE_WAIT");
    return value == nullptr ? 0 : std::atoi(value);
  }();
  return mode;
}

bool RunLoopOnce(HorovodGlobalState& state) {
  int idle_wait = IdleWaitMode();
  if (idle_wait > 0 && !state.shut_down && !state.dynamic_process_sets &&
      state.process_set_table.Ids().size() == 1) {
    auto cycle = std::chrono::microseconds(
        long(state.parameter_manager.CycleTimeMs() * 1000.));
    if (state.process_set_table.Get(0).tensor_queue.WaitForWork(
            std::chrono::milliseconds(50))) {
      auto woke = std::chrono::steady_clock::now();
      state.last_cycle_start = idle_wait == 1 ? woke : woke - cycle;
    }
  }
  // This delay determines thread frequency and communication message latency
  auto start_time = std::chrono::steady_clock::now();
""", 1),
    (OPERATIONS, """    horovod_global.shut_down = true;
    horovod_global.background_thread.join();
""", """    horovod_global.shut_down = true;
    horovod_global.process_set_table.Get(0).tensor_queue.Wake();
    horovod_global.background_thread.join();
""", 1),
]


FIND_PYTORCH = os.path.join("cmake", "Modules", "FindPytorch.cmake")
CUDA_TEST = 'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
CPU_UNLESS_ASKED = CUDA_TEST + """# hvdtrain (fix 4): a CUDA build of torch makes a CUDA Horovod only when GPU operations were asked for.
if(Pytorch_CUDA AND NOT HAVE_CUDA)
    message(STATUS "hvdtrain: torch is a CUDA build, but no GPU operations were asked for: building for the CPU")
    set(Pytorch_CUDA FALSE)
endif()
"""

GPU_ASKED = ("DEFINED HOROVOD_GPU_ALLREDUCE OR DEFINED HOROVOD_GPU_ALLGATHER OR DEFINED HOROVOD_GPU_BROADCAST OR "
             "DEFINED HOROVOD_GPU_ALLTOALL OR DEFINED HOROVOD_GPU_REDUCESCATTER")
CUDA_LANGUAGE = [  # (old, new) in the top-level CMakeLists.txt: the compiler search inside "GPU operations asked for"
    ("include(CheckLanguage)\n", f"# hvdtrain (fix 4): a CUDA compiler only when GPU operations were asked for\n"
                                 f"if({GPU_ASKED})\ninclude(CheckLanguage)\n"),
    ("    enable_language(CUDA)\nendif()\n", "    enable_language(CUDA)\nendif()\nendif()  # hvdtrain (fix 4)\n"),
]


HANDLES_H = os.path.join("horovod", "torch", "handle_manager.h")
HANDLES_CC = os.path.join("horovod", "torch", "handle_manager.cc")
TORCH_OPS = os.path.join("horovod", "torch", "mpi_ops_v2.cc")
# (file, old, new, count) for fix 5.
BLOCKING_WAIT = [
    (HANDLES_H, "#include <atomic>\n", "#include <atomic>\n#include <condition_variable>\n", 1),
    (HANDLES_H, "  std::shared_ptr<Status> ReleaseHandle(int handle);\n",
     "  std::shared_ptr<Status> ReleaseHandle(int handle);\n"
     "  // hvdtrain (fix 5): block until the handle is done (or cleared), without spinning\n"
     "  void WaitForHandle(int handle);\n", 1),
    (HANDLES_H, "  std::mutex mutex_;\n", "  std::mutex mutex_;\n  std::condition_variable done_;  // hvdtrain (fix 5)\n", 1),
    (HANDLES_CC, """void HandleManager::MarkDone(int handle, const Status& status) {
  std::lock_guard<std::mutex> guard(mutex_);
  results_[handle] = std::make_shared<Status>(status);
}
""", """void HandleManager::MarkDone(int handle, const Status& status) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    results_[handle] = std::make_shared<Status>(status);
  }
  done_.notify_all();  // hvdtrain (fix 5)
}

// hvdtrain (fix 5): the waiting thread sleeps until MarkDone or Reset instead of polling.
void HandleManager::WaitForHandle(int handle) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (results_.find(handle) == results_.end()) {
    throw std::invalid_argument("Handle " + std::to_string(handle) +
                                " was not created or has been cleared.");
  }
  done_.wait(lock, [&] {
    auto found = results_.find(handle);
    return found == results_.end() || found->second != nullptr;
  });
}
""", 1),
    (HANDLES_CC, """  results_.clear();
  last_handle_ = 0;
}
""", """  results_.clear();
  last_handle_ = 0;
  done_.notify_all();  // hvdtrain (fix 5): a waiter on a cleared handle wakes and reports it
}
""", 1),
    (TORCH_OPS, """void WaitAndClear(int handle) {
  while (true) {
    if (handle_manager.PollHandle(handle)) break;
    {
      py::gil_scoped_release release_python_gil;
      std::this_thread::yield();
    }
  }
""", """void WaitAndClear(int handle) {
  // hvdtrain (fix 5): sleep until the op completes; spinning here took the CPU the background thread needs.
  // HOROVOD_SPIN_WAIT=1 keeps 0.28.1's loop (read at each wait, so a process may switch).
  const char* spin_env = std::getenv("HOROVOD_SPIN_WAIT");
  const bool spin = spin_env != nullptr && std::string(spin_env) == "1";
  while (spin) {
    if (handle_manager.PollHandle(handle)) break;
    {
      py::gil_scoped_release release_python_gil;
      std::this_thread::yield();
    }
  }
  if (!spin) {
    py::gil_scoped_release release_python_gil;
    handle_manager.WaitForHandle(handle);
  }
""", 1),
]


UTIL = os.path.join("horovod", "common", "util.py")
# (file, old, new, count) for fix 6.
BUILT_FLAGS = [
    (UTIL, """        try:
            ext = importlib.import_module('.' + ext_base_name, 'horovod')
            result = fn(ext)
""", """        try:
            if fn_desc.startswith('built with'):  # hvdtrain (fix 6): the library alone, no framework import
                ext = _extension_library(ext_base_name)
            else:
                ext = importlib.import_module('.' + ext_base_name, 'horovod')
            result = fn(ext)
""", 1),
    (UTIL, """def extension_available(ext_base_name, verbose=False):
""", """def _extension_library(ext_base_name):
    \"\"\"hvdtrain (fix 6): the extension's compiled library, loaded without its framework, for what the build holds
    (mpi_built, gloo_built, ...); ImportError, as its import would give, when it was not built.\"\"\"
    from horovod.common.basics import HorovodBasics
    lib = 'mpi_lib_v2' if ext_base_name == 'torch' else 'mpi_lib'
    pkg_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ext_base_name,
                            '__init__.py')
    check_extension('horovod.' + ext_base_name, 'HOROVOD_WITH_' + ext_base_name.upper(), pkg_path, lib)
    return HorovodBasics(pkg_path, lib)


def extension_available(ext_base_name, verbose=False):
""", 1),
]


GLOO_CONTROLLER = os.path.join("horovod", "common", "gloo", "gloo_controller.cc")
# (file, old, new, count) for fix 7.
GLOO_RANKS = [
    (GLOO_CONTROLLER, "  global_ranks_.reserve(size_);\n",
     "  global_ranks_.resize(size_);  // hvdtrain (fix 7): reserve() left it empty for the stall inspector\n", 1),
]


EXCHANGE_CODE = """// hvdtrain (fix 12): the negotiation's bit vectors combined in one exchange instead of Gloo's ring.
namespace {

// The Gloo tag of the exchange: Horovod's collectives leave the tag at 0 (fix 11's allreduce has a prefix of its own).
constexpr uint32_t kExchangeTag = 0x68766475;
// Up to this many ranks in a process set (each sends size - 1 vectors a round); beyond, Gloo's ring.
constexpr int kExchangeMaxRanks = 16;

// Every rank sends its vector to every other (Gloo's alltoall of the vector repeated once per rank) and combines
// what it receives with ``op``: one round of messages, where Gloo's ring passes the vector from rank to rank
// (2 (size - 1) hops in a row, each a wake-up of the next rank's background thread). The result is the same on every
// rank, as the ring's: AND and OR are exact in any order.
template <typename Op>
void ExchangeBits(const std::shared_ptr<gloo::Context>& ctx, std::vector<long long>& bits, int count, Op op) {
  const int size = ctx->size;
  if (size == 1 || count == 0) {
    return;
  }
  std::vector<long long> mine((size_t)count * size), peers((size_t)count * size);
  for (int r = 0; r < size; r++) {
    std::copy(bits.begin(), bits.begin() + count, mine.begin() + (size_t)r * count);
  }
  gloo::AlltoallOptions opts(ctx);
  opts.setInput(mine.data(), mine.size());
  opts.setOutput(peers.data(), peers.size());
  opts.setTag(kExchangeTag);
  gloo::alltoall(opts);
  for (int r = 0; r < size; r++) {
    for (int k = 0; k < count; k++) {
      bits[k] = op(bits[k], peers[(size_t)r * count + k]);
    }
  }
}

} // namespace

"""
AGREE_EXCHANGE = """  for (int r = 0; r < size_; ++r) {
    global_rank_to_controller_rank_[global_ranks_[r]] = r;
  }

  // hvdtrain (fix 12): whether the negotiation's bit vectors go in one exchange, agreed by the ranks: one that sets
  // HOROVOD_GLOO_RING_NEGOTIATION=1 gives every rank Gloo's ring (Horovod's own), so a variable set on some hosts
  // only cannot split them.
  {
    const char* ring = std::getenv("HOROVOD_GLOO_RING_NEGOTIATION");
    long long off = (ring != nullptr && std::atoi(ring) > 0) ? 1 : 0;
    gloo::AllreduceOptions opts(gloo_context_.ctx);
    opts.setOutput(&off, 1);
    void (*func)(void*, const void*, const void*, size_t) = &BitOr<long long>;
    opts.setReduceFunction(gloo::AllreduceOptions::Func(func));
    gloo::allreduce(opts);
    exchange_bits_ = off == 0 && size_ <= kExchangeMaxRanks;
  }
"""
GLOO_CONTROLLER_H = os.path.join("horovod", "common", "gloo", "gloo_controller.h")
# (file, old, new, count) for fix 12.
GLOO_EXCHANGE = [
    (GLOO_CONTROLLER, "#include <cstring>\n",
     "#include <algorithm>\n#include <cstdlib>\n#include <cstring>\n#include <memory>\n#include <vector>\n", 1),
    (GLOO_CONTROLLER, "void GlooController::DoInitialization() {\n",
     EXCHANGE_CODE + "void GlooController::DoInitialization() {\n", 1),
    (GLOO_CONTROLLER, """  for (int r = 0; r < size_; ++r) {
    global_rank_to_controller_rank_[global_ranks_[r]] = r;
  }
""", AGREE_EXCHANGE, 1),
    (GLOO_CONTROLLER_H, """  void DoInitialization() override;

  GlooContext& gloo_context_;
""", """  void DoInitialization() override;

  GlooContext& gloo_context_;
  bool exchange_bits_ = false;  // hvdtrain (fix 12): the bit vectors in one exchange (agreed at initialization)
""", 1),
    (GLOO_CONTROLLER, """  gloo::AllreduceOptions opts(gloo_context_.ctx);
  opts.setOutput(bitvector.data(), count);
  void (*func)(void*, const void*, const void*, size_t) = &BitAnd<long long>;
""", """  if (exchange_bits_) {  // hvdtrain (fix 12): one exchange, not Gloo's ring
    ExchangeBits(gloo_context_.ctx, bitvector, count, [](long long a, long long b) { return a & b; });
    return;
  }
  gloo::AllreduceOptions opts(gloo_context_.ctx);
  opts.setOutput(bitvector.data(), count);
  void (*func)(void*, const void*, const void*, size_t) = &BitAnd<long long>;
""", 1),
    (GLOO_CONTROLLER, """  gloo::AllreduceOptions opts(gloo_context_.ctx);
  opts.setOutput(bitvector.data(), count);
  void (*func)(void*, const void*, const void*, size_t) = &BitOr<long long>;
""", """  if (exchange_bits_) {  // hvdtrain (fix 12): one exchange, not Gloo's ring
    ExchangeBits(gloo_context_.ctx, bitvector, count, [](long long a, long long b) { return a | b; });
    return;
  }
  gloo::AllreduceOptions opts(gloo_context_.ctx);
  opts.setOutput(bitvector.data(), count);
  void (*func)(void*, const void*, const void*, size_t) = &BitOr<long long>;
""", 1),
]

REDUCE_SCATTER = os.path.join("third_party", "gloo", "gloo", "reduce_scatter.h")
DISTRIBUTION = '''    index = 0;
    bufferOffset = 0;
    for (const auto& distMap : distMapForRecv_) {
'''
# (file, old, new, count) for fix 8: wait for the sends before the distribution phase's writes into ptrs_[0].
GLOO_REDUCE_SCATTER = [
    (REDUCE_SCATTER, DISTRIBUTION, '''    // hvdtrain (fix 8): the copies below write into ptrs_[0], which the sends posted above may still be reading
    // (a send returns before the transport has written its bytes): wait for every one of them first.
    for (int i = 0; i < stepsWithinBlock_; i++) {
      if (sendOffsets_[i] < count_) {
        sendDataBufs_[i]->waitSend();
      }
    }
    if (nextLargerBlockSize_ != 0 && totalItemsToSend != 0) {
      for (int i = 0; i < nextLargerBlockSize_ / myBinaryBlockSize_; i++) {
        if (sendCountToLargerBlock_ * i < totalItemsToSend) {
          largerBlockSendDataBufs_[i]->waitSend();
        }
      }
    }
    for (int i = 0; i < index; i++) {
      distSendDataBufs_[i]->waitSend();
    }
''' + DISTRIBUTION, 1),
]


PAIR_H = os.path.join("third_party", "gloo", "gloo", "transport", "tcp", "pair.h")
PAIR_CC = os.path.join("third_party", "gloo", "gloo", "transport", "tcp", "pair.cc")
ASYNC_EAGAIN = """          } else {
            // Async mode: can't read more than this.
          }
          return false;
"""
UNREGISTERED = """    const auto nbytes = prepareRead(rx_, buf, iov);
    if (nbytes < 0) {
      return false;
    }
"""
# (file, old, new, count) for fix 9: wake the reading thread when the rest of the part it reads has arrived.
GLOO_READ_LOW_WATER = [
    (PAIR_H, "  int fd_;\n", "  int fd_;\n  int rcvlowat_ = 1;  // hvdtrain (fix 9): this socket's SO_RCVLOWAT\n", 1),
    (PAIR_CC, "// read is called from:\n", """// hvdtrain (fix 9): HOROVOD_GLOO_RCVLOWAT, the most bytes a paused read waits for (0: Gloo's own reads),
// read once.
static int ReadLowWaterCap() {
  static const int cap = [] {
    const char* value = getenv("HOROVOD_GLOO_RCVLOWAT");
    return value == nullptr ? 32768 : std::max(0, std::atoi(value));
  }();
  return cap;
}

// hvdtrain (fix 9): epoll reports the socket readable once min(wanted, cap) bytes (at least 1) are there.
static void SetReadLowWater(int fd, int& current, size_t wanted) {
  const int value = int(std::max<size_t>(1, std::min<size_t>(wanted, size_t(ReadLowWaterCap()))));
  if (value != current &&
      setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &value, sizeof(value)) == 0) {
    current = value;
  }
}

// read is called from:
""", 1),
    (PAIR_CC, ASYNC_EAGAIN, """          } else {
            // Async mode: can't read more than this.
            // hvdtrain (fix 9): sleep until the rest of this part (or HOROVOD_GLOO_RCVLOWAT bytes of it) is here.
            SetReadLowWater(fd_, rcvlowat_, iov.iov_len);
          }
          return false;
""", 1),
    (PAIR_CC, UNREGISTERED, """    const auto nbytes = prepareRead(rx_, buf, iov);
    if (nbytes < 0) {
      SetReadLowWater(fd_, rcvlowat_, 1);  // hvdtrain (fix 9): a later wake-up reads it, whatever is there
      return false;
    }
""", 1),
]


TIMELINE_CC = os.path.join("horovod", "common", "timeline.cc")
# (file, old, new, count) for fix 10: the timeline writer sleeps while its queue is empty.
TIMELINE_IDLE = [
    (TIMELINE_CC, """    // Allow scheduler to schedule other work for this core.
    std::this_thread::yield();
""", """    // hvdtrain (fix 10): nothing queued: sleep, instead of yielding in a loop that takes every cycle it is
    // given for as long as the job runs (a start or stop of the timeline waits 5 ms at most).
    if (record_queue_.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
""", 1),
]


GLOO_OPS_H = os.path.join("horovod", "common", "ops", "gloo_operations.h")
GLOO_OPS_CC = os.path.join("horovod", "common", "ops", "gloo_operations.cc")
BESIDE_CODE = """// hvdtrain (fix 11): an allreduce of at least HOROVOD_GLOO_ASYNC_BYTES bytes runs beside the background thread.
namespace {

// The Gloo tag of the allreduce that runs beside: every other collective of Horovod leaves Gloo's tag at 0.
constexpr uint32_t kBesideTag = 0x68766474;

// One thread that runs one job at a time; Start waits for the job before it.
class BesideRunner {
public:
  void Start(std::function<void()> job) {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return !busy_; });
    job_ = std::move(job);
    busy_ = true;
    if (!started_) {
      std::thread(&BesideRunner::Loop, this).detach();
      started_ = true;
    }
    work_.notify_one();
  }

  void Drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return !busy_; });
  }

private:
  void Loop() {
#if defined(__linux__)
    // Named, so that a rank's CPU by thread tells it from the framework's threads (hvdtrain.threads).
    pthread_setname_np(pthread_self(), "hvd beside");
#endif
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [this] { return job_ != nullptr; });
      auto job = std::move(job_);
      job_ = nullptr;
      lock.unlock();
      job();
      lock.lock();
      busy_ = false;
      idle_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::function<void()> job_;
  bool busy_ = false;
  bool started_ = false;
};

// Never destroyed: its detached thread may still wait on it while the process exits.
BesideRunner& Beside() {
  static BesideRunner* runner = new BesideRunner();
  return *runner;
}

} // namespace

void GlooAllreduceDrain() { Beside().Drain(); }

int64_t GlooAllreduce::BesideBytes(const TensorTableEntry& first_entry,
                                   GlooContext& gloo_context) {
  if (first_entry.process_set_id != 0 || first_entry.device != CPU_DEVICE_ID) {
    return 0;
  }
  if (!beside_agreed_) {
    // Every rank runs this same first allreduce of the global set: the ranks agree on the smallest value, so that
    // a variable set on some hosts only turns it off rather than splitting them.
    const char* value = std::getenv("HOROVOD_GLOO_ASYNC_BYTES");
    int64_t bytes = value == nullptr ? 0 : std::max<int64_t>(0, std::strtoll(value, nullptr, 10));
    GlooAlgorithms<int64_t> agree(&gloo_context);
    agree.Allreduce(&bytes, 1, ReduceOp::MIN);
    beside_bytes_ = gloo_context.ctx->size > 1 ? bytes : 0;
    beside_agreed_ = true;
  }
  return beside_bytes_;
}

Status GlooAllreduce::ExecuteBeside(std::vector<TensorTableEntry>& entries,
                                    ReduceOp reduce_op, double prescale_factor,
                                    double postscale_factor,
                                    GlooContext* gloo_context) {
  // The one before it first: every rank waits here at the same response, for an allreduce every rank has started.
  Beside().Drain();
  auto& timeline = global_state_->timeline;
  auto& first_entry = entries[0];
  int64_t num_elements = NumElements(entries);
  void* buffer_data;
  if (entries.size() > 1) {
    // A buffer of its own: the fusion buffer is the next collective's while this one is on the wire.
    timeline.ActivityStartAll(entries, MEMCPY_IN_FUSION_BUFFER);
    int64_t bytes = 0;
    for (auto& e : entries) {
      bytes += e.tensor->size();
    }
    if ((int64_t)beside_buffer_.size() < bytes) {
      beside_buffer_.resize(bytes);
    }
    buffer_data = beside_buffer_.data();
    int64_t offset = 0;
    for (auto& e : entries) {
      MemcpyEntryInFusionBuffer(entries, e, (uint8_t*)buffer_data + offset);
      offset += e.tensor->size();
    }
    timeline.ActivityEndAll(entries);
  } else {
    buffer_data = (void*)first_entry.output->data();
    if (buffer_data != first_entry.tensor->data()) {
      std::memcpy(buffer_data, first_entry.tensor->data(),
                  (size_t)first_entry.tensor->size());
    }
  }
  if (prescale_factor != 1.0) {
    ScaleBuffer(prescale_factor, entries, buffer_data, buffer_data, num_elements);
  }
  DataType dtype = first_entry.tensor->dtype();
  auto held = std::make_shared<std::vector<TensorTableEntry>>(std::move(entries));
  Beside().Start([this, held, reduce_op, postscale_factor, gloo_context, buffer_data,
                  num_elements, dtype]() {
    auto& timeline = global_state_->timeline;
    auto& done = *held;
    Status status = Status::OK();
    try {
      timeline.ActivityStartAll(done, GLOO_ALLREDUCE);
      std::unique_ptr<IGlooAlgorithms> gloo_algos(
          GetAlgorithmsForType(dtype, gloo_context));
      gloo_algos->Allreduce(buffer_data, (int)num_elements, reduce_op, kBesideTag);
      timeline.ActivityEndAll(done);
      if (postscale_factor != 1.0) {
        ScaleBuffer(postscale_factor, done, buffer_data, buffer_data, num_elements);
      }
      if (done.size() > 1) {
        timeline.ActivityStartAll(done, MEMCPY_OUT_FUSION_BUFFER);
        MemcpyOutFusionBuffer(buffer_data, done);
        timeline.ActivityEndAll(done);
      }
    } catch (const std::exception& ex) {
      status = Status::UnknownError(ex.what());
    }
    for (auto& e : done) {
      timeline.End(e.tensor_name, status.ok() ? e.output : nullptr);
      e.FinishWithCallback(status);
    }
  });
  return Status::InProgress();
}

"""
# (file, old, new, count) for fix 11.
GLOO_BESIDE = [
    (GLOO_OPS_H, "#include <stdint.h>\n#include <vector>\n",
     "#include <stdint.h>\n#include <vector>\n#include <algorithm>\n#include <condition_variable>\n#include <cstdlib>\n"
     "#include <cstring>\n#include <functional>\n#include <memory>\n#include <mutex>\n#include <thread>\n"
     "#include <pthread.h>\n", 1),
    (GLOO_OPS_H, """  virtual void Allreduce(void* buffer_data, int num_elements,
                         ReduceOp reduce_op) = 0;
""", """  virtual void Allreduce(void* buffer_data, int num_elements,
                         ReduceOp reduce_op, uint32_t tag = 0) = 0;  // hvdtrain (fix 11): the tag
""", 1),
    (GLOO_OPS_H, """  void Allreduce(void* buffer_data, int num_elements,
                 ReduceOp reduce_op) override;
""", """  void Allreduce(void* buffer_data, int num_elements,
                 ReduceOp reduce_op, uint32_t tag = 0) override;
""", 1),
    (GLOO_OPS_H, """  explicit GlooAllreduce(HorovodGlobalState* global_state);

  Status Execute(std::vector<TensorTableEntry>& entries,
                 const Response& response) override;

  bool Enabled(const ParameterManager& param_manager,
               const std::vector<TensorTableEntry>& entries,
               const Response& response) const override;
};
""", """  explicit GlooAllreduce(HorovodGlobalState* global_state);

  Status Execute(std::vector<TensorTableEntry>& entries,
                 const Response& response) override;

  bool Enabled(const ParameterManager& param_manager,
               const std::vector<TensorTableEntry>& entries,
               const Response& response) const override;

private:
  // hvdtrain (fix 11): the size from which an allreduce runs beside the background thread (0: never).
  int64_t BesideBytes(const TensorTableEntry& first_entry, GlooContext& gloo_context);
  Status ExecuteBeside(std::vector<TensorTableEntry>& entries, ReduceOp reduce_op,
                       double prescale_factor, double postscale_factor,
                       GlooContext* gloo_context);
  bool beside_agreed_ = false;
  int64_t beside_bytes_ = 0;
  std::vector<uint8_t> beside_buffer_;
};

// hvdtrain (fix 11): wait for the allreduce running beside the background thread, if one is.
void GlooAllreduceDrain();
""", 1),
    (GLOO_OPS_CC, """void GlooAlgorithms<T>::Allreduce(void* buffer_data, int num_elements,
                                  ReduceOp reduce_op) {
  gloo::AllreduceOptions opts(gloo_context_->ctx);
""", """void GlooAlgorithms<T>::Allreduce(void* buffer_data, int num_elements,
                                  ReduceOp reduce_op, uint32_t tag) {
  gloo::AllreduceOptions opts(gloo_context_->ctx);
  opts.setTag(tag);
""", 1),
    (GLOO_OPS_CC, "GlooAllreduce::GlooAllreduce(HorovodGlobalState* global_state)\n",
     BESIDE_CODE + "GlooAllreduce::GlooAllreduce(HorovodGlobalState* global_state)\n", 1),
    (GLOO_OPS_CC, """    throw std::logic_error("Reduction op type not supported.");
  }

  const void* fused_input_data;
""", """    throw std::logic_error("Reduction op type not supported.");
  }

  int64_t beside_bytes = BesideBytes(first_entry, gloo_context);
  if (beside_bytes > 0) {
    int64_t bytes = 0;
    for (auto& e : entries) {
      bytes += e.tensor->size();
    }
    if (bytes >= beside_bytes) {  // hvdtrain (fix 11)
      return ExecuteBeside(entries, glooOp, prescale_factor, postscale_factor, &gloo_context);
    }
  }

  const void* fused_input_data;
""", 1),
    (OPERATIONS, """  // Signal that shutdown has been requested.
  state.shut_down = true;
""", """  // Signal that shutdown has been requested.
  state.shut_down = true;

#if HAVE_GLOO
  // hvdtrain (fix 11): the allreduce running beside this thread ends (or fails) before the contexts go.
  GlooAllreduceDrain();
#endif
""", 1),
]

class PatchError(RuntimeError):
    pass


def _replace(path: str, old: str, new: str, count: int) -> str:
    """Replace ``count`` occurrences of ``old`` in ``path``; 'patched' when only ``new`` is found ``count`` times."""
    with open(path) as f:
        text = f.read()
    found, done = text.count(old), text.count(new)
    if done >= count and (found == 0 or old in new):  # old in new: the fix inserts text around the old one
        return "already patched"
    if found != count:
        raise PatchError(f"{path}: expected {count} occurrence(s) of the text to patch, found {found}: "
                         f"is this Horovod 0.28.1?")
    with open(path, "w") as f:
        f.write(text.replace(old, new))
    return "patched"

FIXES = {  # number -> its (file, old, new, count) replacements
    1: [(name, CXX14, CXX17, 1) for name in CXX_FILES],
    2: [(OPERATIONS, TRACE_AFTER, TRACE_BEFORE, TRACE_SITES)],
    3: IDLE_WAIT,
    4: [(FIND_PYTORCH, CUDA_TEST, CPU_UNLESS_ASKED, 1)] + [(CXX_FILES[0], old, new, 1) for old, new in CUDA_LANGUAGE],
    5: BLOCKING_WAIT,
    6: BUILT_FLAGS,
    7: GLOO_RANKS,
    8: GLOO_REDUCE_SCATTER,
    9: GLOO_READ_LOW_WATER,
    10: TIMELINE_IDLE,
    11: GLOO_BESIDE,
    12: GLOO_EXCHANGE,
}
BUILD_ONLY = (1, 4)
"""Fixes that only let the sdist compile here (no behaviour of the library changes): a build with only these is a
stock Horovod as far as hvdtrain can tell, and carries no horovod_hvdtrain_fixes()."""
MARKER_AFTER = """bool horovod_gloo_built() {
#if HAVE_GLOO
  return true;
#else
  return false;
#endif
}
"""


def marker(fixes) -> str:
    """The C function that tells hvdtrain which fixes the library was built with."""
    numbers = ",".join(str(n) for n in sorted(fixes))
    return (f"{MARKER_AFTER}\n// hvdtrain: the numbers of hvdtrain's fixes (scripts/patch_horovod.py) this library was "
            f"built with,\n// read by hvdtrain.horovod_fixes through ctypes.\n"
            f"const char* horovod_hvdtrain_fixes() {{ return \"{numbers}\"; }}\n")


def parse_fixes(text: str) -> List[int]:
    """'1,4' -> [1, 4]; '' or 'all' -> every fix. PatchError for a number that is no fix."""
    if text.strip() in ("", "all"):
        return sorted(FIXES)
    try:
        wanted = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        wanted = [0]
    unknown = [n for n in wanted if n not in FIXES]
    if unknown or not wanted:
        raise PatchError(f"--fixes {text!r}: give fix numbers from 1 to {max(FIXES)}, comma-separated, or all")
    return wanted


def patch(src: str, fixes=None) -> List[Tuple[str, str]]:
    """Apply ``fixes`` (numbers; default every fix) under ``src``, and the marker when any of them changes what the
    library does; returns (file, outcome) pairs; PatchError says what did not fit."""
    if not os.path.isfile(os.path.join(src, OPERATIONS)):
        raise PatchError(f"{src} is not an unpacked Horovod source tree (no {OPERATIONS})")
    fixes = sorted(FIXES) if fixes is None else sorted(fixes)
    done = [(name, _replace(os.path.join(src, name), old, new, count))
            for number in fixes for name, old, new, count in FIXES[number]]
    if set(fixes) - set(BUILD_ONLY):
        done.append((OPERATIONS, _replace(os.path.join(src, OPERATIONS), MARKER_AFTER, marker(fixes), 1)))
    return done


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = os.environ.get("HVDTRAIN_HOROVOD_FIXES", "")
    if len(argv) == 3 and argv[1] == "--fixes":
        argv, chosen = argv[:1], argv[2]
    if len(argv) != 1:
        print("usage: python scripts/patch_horovod.py SRC_DIR [--fixes N,N,...]", file=sys.stderr)
        return 2
    try:
        for name, outcome in patch(argv[0], parse_fixes(chosen)):
            print(f"patch_horovod: {name}: {outcome}", file=sys.stderr)
    except (PatchError, OSError) as e:
        print(f"patch_horovod: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
