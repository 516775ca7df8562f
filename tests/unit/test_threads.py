"""hvdtrain.threads: a rank's CPU by thread role, from /proc (the per-thread breakdown of every epoch's record)."""
import threading
import time

import pytest

from hvdtrain import threads


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_created_by_a_start_up_call_are_told_apart_and_their_cpu_counted():
    """Threads a start-up call creates: the first is Horovod's background thread, the rest its transport; a thread
    born elsewhere is the framework's; CPU of a thread that ended in the interval is "ended"; the roles add up to the
    process's CPU time."""
    stop = threading.Event()

    def spin():  # a thread that keeps burning until told to stop
        while not stop.is_set():
            _burn(0.01)

    with threads.created_by("horovod", "transport"):
        background = threading.Thread(target=spin, name="x")
        background.start()
        transport = threading.Thread(target=stop.wait, name="y")
        transport.start()
    assert {background.native_id, transport.native_id} <= threads.known_threads()
    meter = threads.ThreadCpu()
    meter.start()
    short = threading.Thread(target=_burn, args=(0.3,))
    short.start()
    short.join()
    _burn(0.3)  # the main thread
    time.sleep(0.3)
    stop.set()
    background.join()
    transport.join()
    time.sleep(0.05)
    seconds = meter.stop()
    assert set(seconds) == set(threads.ROLES)
    assert seconds["main"] >= 0.25, seconds
    assert seconds["ended"] >= 0.2, seconds  # the short thread, and the two that were joined
    total = sum(seconds.values())
    assert total == pytest.approx(seconds["main"] + seconds["ended"] + seconds["horovod"] + seconds["transport"]
                                  + seconds["framework"] + seconds["python"])


def test_a_live_background_thread_is_counted_as_horovods():
    burnt, stop = threading.Event(), threading.Event()

    def work():  # a fixed amount of CPU, whatever the machine's load, then alive and idle
        _burn(0.3)
        burnt.set()
        stop.wait()

    meter = threads.ThreadCpu()
    with threads.created_by("horovod", "transport"):
        worker = threading.Thread(target=work)
        meter.start()
        worker.start()
    burnt.wait()
    seconds = meter.stop()
    stop.set()
    worker.join()
    assert seconds["horovod"] >= 0.25, seconds
    assert seconds["main"] < seconds["horovod"], seconds  # the main thread waited


def test_other_python_threads_are_python_and_per_step_follows_the_roles():
    burnt, stop = threading.Event(), threading.Event()
    # a fixed amount of the thread's own CPU, then alive and idle: waited for by event, not by a sleep (on a loaded
    # machine the thread had burnt 0.09 s of its 0.3 s after half a second)
    t = threading.Thread(target=lambda: (_burn(0.3), burnt.set(), stop.wait()), name="hvdtrain-heartbeat-0")
    meter = threads.ThreadCpu()
    meter.start()
    t.start()
    burnt.wait()
    seconds = meter.stop()
    stop.set()
    t.join()
    assert seconds["python"] >= 0.2, seconds
    steps = threads.per_step(seconds, 10)
    assert len(steps) == len(threads.ROLES)
    assert steps[threads.ROLES.index("python")] == pytest.approx(seconds["python"] / 10)


def test_thread_ticks_reads_every_thread():
    ticks = threads.thread_ticks()
    assert threading.main_thread().native_id in ticks
    assert threads.thread_ticks("0-no-such-process") == {}


def test_wakeups_count_each_sleep_of_a_thread_by_role():
    """A thread woken 30 times (a condition each time) shows at least 30 wake-ups under its role, over the interval
    only; a process without /proc reads as no threads."""
    ready, go, done, leave = threading.Semaphore(0), threading.Semaphore(0), threading.Event(), threading.Event()

    def waiter():
        for _ in range(30):
            ready.release()
            go.acquire()  # sleeps until the main thread releases it: one voluntary context switch at least
        done.set()
        leave.wait()  # alive when the meter stops: a thread that ended has no count left to read

    t = threading.Thread(target=waiter, name="hvdtrain-waiter")
    t.start()
    ready.acquire()
    meter = threads.ThreadCpu()
    meter.start()
    for i in range(30):
        time.sleep(0.002)  # the waiter is asleep in acquire() before it is released
        go.release()
        if i < 29:
            ready.acquire()
    done.wait(10)
    meter.stop()
    leave.set()
    t.join()
    assert meter.wakeups["python"] >= 29, meter.wakeups
    assert set(meter.wakeups) == set(threads.ROLES) - {"ended"}
    assert threading.main_thread().native_id in threads.thread_wakeups()
    assert threads.thread_wakeups("0-no-such-process") == {}


def test_a_thread_named_by_horovods_fix_11_is_horovods_whenever_it_was_born():
    """hvdtrain's Horovod starts the thread for a large allreduce at the first one, long after hvd.init() (fix 11),
    and names it "hvd beside": its CPU is Horovod's, not the framework's."""
    import ctypes
    setname = ctypes.CDLL(None).pthread_setname_np
    self_id = ctypes.CDLL(None).pthread_self
    self_id.restype = ctypes.c_ulong
    setname.argtypes = [ctypes.c_ulong, ctypes.c_char_p]
    meter = threads.ThreadCpu()
    meter.start()

    def beside():
        setname(self_id(), b"hvd beside")
        _burn(0.3)
        burnt.set()
        done.wait()

    burnt, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=beside)
    worker.start()
    assert burnt.wait(60)
    assert threads.thread_names()[worker.native_id] == "hvd beside"
    seconds = meter.stop()
    done.set()
    worker.join()
    assert seconds["horovod"] >= 0.25 and seconds["python"] < 0.1, seconds
