"""Horovod's negotiation rounds combine their bit vectors in one exchange among the ranks, where Gloo's ring passed
them from rank to rank (scripts/patch_horovod.py fix 12): what the rounds decide is unchanged, checked through every
path of the response cache (hits, rounds in which only some ranks have a tensor, invalidated entries, new names), on
the global set and on a process set whose Gloo context numbers its ranks otherwise (tests/exchange_check.py). That
the project's library has the fix is tests/unit/test_horovod_fixes.py's check."""
import re

import pytest

from tests.helpers import PY, ROOT, describe, horovodrun, run

CHECK = f"{ROOT}/tests/exchange_check.py"


@pytest.mark.parametrize("ranks,extra", [(3, ()), (4, ()), (3, ("--ring-on-rank0",))],
                         ids=["3 ranks", "4 ranks", "the ring asked for on rank 0 only"])
def test_every_negotiation_path_decides_as_before_with_odd_and_even_rank_counts(ranks, extra):
    # with the ring asked for on one rank, the ranks must agree (all in the ring) instead of waiting in different
    # protocols until Gloo's timeout (60 s here, under the test's limit)
    result = run(horovodrun(ranks, PY, CHECK, "12", *extra), timeout=300, HOROVOD_GLOO_TIMEOUT_SECONDS=60)
    assert result.returncode == 0, describe(result)
    done = sorted(re.findall(r"rank (\d): 12 rounds right", result.output))
    assert done == [str(r) for r in range(ranks)], describe(result)


@pytest.mark.parametrize("extra", [(), ("--ring-on-rank0",)], ids=["exchange", "ring"])
def test_a_peer_gone_while_the_others_negotiate_fails_their_allreduce_at_once(extra):
    # ranks 0 and 2 wait in negotiation rounds for rank 1's bits when it exits: each must see the lost connection and
    # raise Horovod's shutdown error, well before Gloo's timeout (60 s here: the lost connection ended it, reset or
    # closed by the peer as the read or the write saw it), in the exchange and in the ring alike
    result = run(horovodrun(3, PY, CHECK, "2", "--peer-exits", *extra), timeout=240, HOROVOD_GLOO_TIMEOUT_SECONDS=60)
    failed = dict(re.findall(r"rank (\d): failed after (\d+\.\d) s: HorovodInternalError: Horovod has been shut down",
                             result.output))
    assert sorted(failed) == ["0", "2"] and all(float(s) < 30 for s in failed.values()), describe(result)
    assert "terminate called" not in result.output, describe(result)  # the error reached Python, no abort
