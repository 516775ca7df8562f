"""A checkpoint inside an epoch holds every rank's own running statistics, and a resume gives each rank its own back
(the average of them at another world size). The ranks of a job are played in one process here, one after another:
what rank 0 broadcasts is what the others receive. tests/e2e/test_data_at_scale.py runs the same through Horovod and
compares the resumed records with an uninterrupted run's."""
import numpy as np
import pytest

from hvdtrain import checkpoint
from hvdtrain.checkpoint_policy import Checkpointer, Position
from hvdtrain.config import TrainConfig

# Two ranks' BatchNorm statistics at step 9, inside an epoch: each followed its own shard.
ROWS = np.array([[0.5, 1.25, 3.0], [0.75, 1.0, 2.0]])


class Reporter:
    def progress(self, step, phase):
        pass


class Rank:
    """The backend calls the checkpointer makes, for rank ``rank`` of ``size``; ``sent`` carries rank 0's
    broadcasts to the others."""
    name = "fake"

    def __init__(self, rank, size, sent):
        self.rank, self.size, self.sent, self.received = rank, size, sent, 0
        self.stats = np.full(ROWS.shape[1], -1.0)  # rank 0's stats arrive with the model; -1: nothing set yet

    def statistics(self):
        return self.stats.copy()

    def set_statistics(self, values):
        self.stats = np.array(values, dtype=np.float64)

    def allgather_array(self, values, tag):
        rows = ROWS.copy()
        rows[self.rank] = values
        return rows

    def gather_state(self):
        pass

    def state_dict(self):
        return {"model": {"w": np.ones(2, np.float32), "running": self.stats.copy()}}

    def load_state_dict(self, state):
        pass

    def broadcast_state(self):
        pass

    def root_decides(self, decide, collective=True, error=None):
        verdict = decide() if self.rank == 0 else self.receive()
        if self.rank == 0:
            self.sent.append(verdict)
        if isinstance(verdict, dict) and "error" in verdict:
            raise error(verdict["error"])
        return verdict

    def broadcast_tree(self, tree, root=0):
        if self.rank == 0:
            self.sent.append(checkpoint.serialize(tree))
            return tree
        return checkpoint.deserialize(self.receive())

    def receive(self):
        self.received += 1
        return self.sent[self.received - 1]


def checkpointer(tmp_path, rank, size, sent):
    return Checkpointer(TrainConfig(output_dir=str(tmp_path)), Rank(rank, size, sent), "recipe", Reporter())


def write_stopped_checkpoint(tmp_path, at=Position(1, 72, 9)):
    """Rank 0 of 2 at a --max-steps stop: the model's statistics averaged, its own (ROWS[0]) kept aside."""
    saver = checkpointer(tmp_path, 0, 2, [])
    saver._gather_and_save(at, statistics=ROWS[0])
    return checkpoint.load(checkpoint.latest_valid(saver.directory))


def resume(tmp_path, size):
    sent, stats = [], []
    for rank in range(size):  # rank 0 first: it loads and broadcasts
        c = checkpointer(tmp_path, rank, size, sent)
        assert c.restore() == Position(1, 72, 9)
        stats.append(c.backend.stats)
    return stats


def test_a_checkpoint_inside_an_epoch_holds_every_ranks_statistics_and_each_rank_resumes_with_its_own(tmp_path):
    saved = write_stopped_checkpoint(tmp_path)
    np.testing.assert_array_equal(saved["statistics_by_rank"], ROWS)
    for rank, stats in enumerate(resume(tmp_path, 2)):
        np.testing.assert_array_equal(stats, ROWS[rank])


def test_a_checkpoint_every_n_steps_saves_the_model_with_the_ranks_average_and_trains_on_with_rank_0s_own(tmp_path):
    """Its model is what an evaluation at that step would score (as at an epoch's end), not rank 0's statistics."""
    saver = checkpointer(tmp_path, 0, 2, [])
    saver.backend.stats = ROWS[0].copy()
    saver._gather_and_save(Position(1, 72, 9))
    saved = checkpoint.load(checkpoint.latest_valid(saver.directory))
    np.testing.assert_array_equal(saved["backend"]["model"]["running"], ROWS.mean(axis=0))
    np.testing.assert_array_equal(saved["statistics_by_rank"], ROWS)
    np.testing.assert_array_equal(saver.backend.stats, ROWS[0])
    for rank, stats in enumerate(resume(tmp_path, 2)):
        np.testing.assert_array_equal(stats, ROWS[rank])


def test_at_another_world_size_every_rank_resumes_with_the_average(tmp_path):
    write_stopped_checkpoint(tmp_path)
    for stats in resume(tmp_path, 3):
        np.testing.assert_array_equal(stats, ROWS.mean(axis=0))


def test_a_checkpoint_at_an_epochs_end_holds_no_rows(tmp_path):
    """There the statistics were averaged on every rank, so the model's are every rank's."""
    saved = write_stopped_checkpoint(tmp_path, Position(2, 0, 12))
    assert "statistics_by_rank" not in saved


def test_rows_that_do_not_fit_the_model_are_refused_in_one_line(tmp_path):
    at = Position(1, 72, 9)
    state = {"trainer": {**at.as_dict(), "recipe": "recipe", "framework": "fake", "world_size": 2},
             "backend": {"model": {}}, "statistics_by_rank": np.zeros((2, 5))}
    checkpoint.save(str(tmp_path / "checkpoints"), at.epoch, at.global_step, state)
    with pytest.raises(checkpoint.CheckpointError, match=r"running statistics by rank have shape \(2, 5\), the "
                                                         r"model's \(3,\)"):
        checkpointer(tmp_path, 0, 2, []).restore()
