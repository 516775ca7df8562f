"""A test whose job runs past its timeout fails with where the job hung: every process's state, the kernel waits of
its threads, its Python stack, and the job's heartbeat table (tests/helpers.py); a hang that does not repeat leaves
nothing else to go by."""
import json
import re
import sys

import pytest

from tests.helpers import run

HANGS = "import time\ndef wait_forever():\n    time.sleep(600)\nwait_forever()\n"


def test_a_job_past_its_timeout_fails_naming_each_process_its_stack_and_the_ranks_progress(tmp_path):
    beats = tmp_path / "out" / "heartbeats"
    beats.mkdir(parents=True)
    (beats / "rank-0.json").write_text(json.dumps({"rank": 0, "step": 17, "phase": "data", "time": 0, "in_phase": 5.0,
                                                   "pid": 1, "host": "h0"}))
    with pytest.raises(AssertionError) as failure:
        run([sys.executable, "-c", HANGS, "--output-dir", str(tmp_path / "out")], timeout=3)
    report = str(failure.value).split("--- where it hung\n")[1]
    assert re.search(r"\(sleeping, [0-9.]+ CPU-s, 1 threads, waiting in ", report), report  # state, kernel wait
    # the Python stack from py-spy, or its reason where it cannot attach (a container without ptrace)
    assert "wait_forever (<string>:3)" in report or "Error" in report, report
    assert "     17  data" in report and "<- silent" in report, report  # the heartbeat table of --output-dir

