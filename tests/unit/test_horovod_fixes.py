"""Which of hvdtrain's Horovod fixes the Horovod in use carries (issue 58, item 3): read from the library itself, a
run refused where its results would be wrong without one, a warning naming those that only slow it or make it less
robust. The stock build itself is run in tests/e2e/test_foreign_horovod.py."""
import pytest

from hvdtrain import horovod_fixes
from hvdtrain.config import ConfigError, TrainConfig

EVERY = frozenset(range(1, 13))


def test_the_projects_build_names_every_fix_through_its_library():
    import horovod.torch  # horovod.mxnet's library is the same build, with the same marker
    assert horovod_fixes.library_fixes(horovod.torch) == EVERY
    assert horovod_fixes.describe(EVERY) == \
        "hvdtrain's fixes 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 (scripts/patch_horovod.py)"


def test_a_stock_build_is_described_fix_by_fix():
    text = horovod_fixes.describe(frozenset())
    assert text.startswith("no hvdtrain fixes: a stock or other build; missing: fix 2: MXNet: ")
    assert [f"fix {n}:" in text for n in (2, 3, 5, 6, 7, 8, 9, 10, 11, 12)] == [True] * 10 and "fix 1:" not in text
    assert horovod_fixes.describe(frozenset({1, 4, 8})).startswith("hvdtrain's fixes 1, 4, 8 only; missing: fix 2:")


@pytest.fixture
def stock(monkeypatch):
    monkeypatch.setattr(horovod_fixes, "library_fixes", lambda hvd: frozenset())


def test_sharding_under_gloo_is_refused_without_fix_8_and_allowed_under_mpi(stock, capsys):
    with pytest.raises(ConfigError, match=r"^--shard-optimizer under Gloo needs hvdtrain's Horovod fix 8 \(Gloo's "
                                          r"reduce-scatter can return wrong values without it\), which this Horovod "
                                          r"lacks: build it with make horovod, or in another environment"):
        horovod_fixes.check(TrainConfig(shard_optimizer=True), None, "torch", gloo=True, rank=0)
    horovod_fixes.check(TrainConfig(shard_optimizer=True), None, "torch", gloo=False, rank=0)  # MPI's reduce-scatter
    assert "lacks hvdtrain's fix(es) 3, 5, 6 (" in capsys.readouterr().err


def test_the_warning_names_what_matters_to_this_run_once_on_rank_0(stock, capsys):
    horovod_fixes.check(TrainConfig(), None, "torch", gloo=True, rank=0)
    horovod_fixes.check(TrainConfig(framework="mxnet", timeline_steps="1:5"), None, "mxnet", gloo=False, rank=0)
    horovod_fixes.check(TrainConfig(), None, "torch", gloo=True, rank=1)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(
        "hvdtrain: warning: this Horovod lacks hvdtrain's fix(es) 3, 5, 6, 7, 9, 11, 12 (every rank ")
    assert err[1].startswith("hvdtrain: warning: this Horovod lacks hvdtrain's fix(es) 2, 3, 6, 10 (MXNet: ")
    assert err[0].endswith("python -m hvdtrain doctor lists them; to get them: " + horovod_fixes.REMEDY)


def test_a_build_with_every_fix_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(horovod_fixes, "library_fixes", lambda hvd: EVERY)
    horovod_fixes.check(TrainConfig(shard_optimizer=True), None, "torch", gloo=True, rank=0)
    assert capsys.readouterr().err == ""
