import os
import pickle

import numpy as np
import pytest

from hvdtrain import checkpoint as ck


def state(v=1.0):
    return {"trainer": {"epoch": 2, "name": "x", "lr": 0.1, "flags": [True, None]},
            "backend": {"model": {"w": np.full((3, 4), v, np.float32), "b": np.arange(4)},
                        "optimizer": {"state": {0: {"momentum_buffer": np.ones(3)}, 1: {"momentum_buffer": None}},
                                      "param_groups": [{"params": [0, 1], "lr": 0.1, "betas": (0.9, 0.99)}]}}}


def test_round_trip_keeps_structure_types_and_values(tmp_path):
    path = ck.save(str(tmp_path), 2, 44, state())
    got = ck.load(path)
    assert got["trainer"] == state()["trainer"]
    np.testing.assert_array_equal(got["backend"]["model"]["w"], state()["backend"]["model"]["w"])
    assert got["backend"]["model"]["w"].dtype == np.float32
    assert got["backend"]["optimizer"]["state"][1]["momentum_buffer"] is None
    assert isinstance(list(got["backend"]["optimizer"]["state"])[0], int)
    assert got["backend"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert open(path + ".sha256").read().split()[1] == os.path.basename(path), "sha256sum -c compatible"


def test_newest_valid_and_pruning(tmp_path):
    for e in range(1, 5):
        ck.save(str(tmp_path), e, e * 10, state(e))
    ck.prune(str(tmp_path), 2)
    names = [os.path.basename(p) for p in ck.list_checkpoints(str(tmp_path))]
    assert names == [ck.checkpoint_name(3, 30), ck.checkpoint_name(4, 40)]
    assert not os.path.exists(os.path.join(tmp_path, ck.checkpoint_name(1, 10) + ".sha256"))
    assert ck.latest_valid(str(tmp_path)).endswith(ck.checkpoint_name(4, 40))


@pytest.mark.parametrize("damage", ["truncate", "zero", "flip", "no_digest"])
def test_corrupt_newest_falls_back_to_previous_with_a_warning(tmp_path, damage):
    ck.save(str(tmp_path), 1, 10, state(1))
    newest = ck.save(str(tmp_path), 2, 20, state(2))
    data = open(newest, "rb").read()
    if damage == "truncate":
        open(newest, "wb").write(data[: len(data) // 2])
    elif damage == "zero":
        open(newest, "wb").close()
    elif damage == "flip":
        i = len(data) // 2
        open(newest, "wb").write(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    else:
        os.unlink(newest + ".sha256")
    warnings = []
    chosen = ck.latest_valid(str(tmp_path), warn=warnings.append)
    assert chosen.endswith(ck.checkpoint_name(1, 10))
    assert len(warnings) == 1 and os.path.basename(newest) in warnings[0]
    with pytest.raises(ck.CheckpointError):
        ck.load(newest)


def test_failed_serialization_leaves_previous_checkpoint_and_no_partial_file(tmp_path):
    good = ck.save(str(tmp_path), 1, 10, state(1))

    def boom(_):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ck.save(str(tmp_path), 2, 20, state(2), serialize_fn=boom)
    assert ck.list_checkpoints(str(tmp_path)) == [good]
    assert ck.latest_valid(str(tmp_path)) == good


def test_leftover_temporaries_are_cleaned(tmp_path):
    ck.save(str(tmp_path), 1, 10, state(1))
    (tmp_path / ".tmp-ckpt-e0002-s000000020.npz.1234").write_bytes(b"partial")
    assert ck.clean_temporaries(str(tmp_path)) == [".tmp-ckpt-e0002-s000000020.npz.1234"]
    assert sorted(os.listdir(tmp_path)) == [ck.checkpoint_name(1, 10), ck.checkpoint_name(1, 10) + ".sha256"]


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


@pytest.mark.parametrize("with_digest", [False, True])
def test_pickle_payload_is_refused_without_running_it(tmp_path, with_digest):
    target = tmp_path / "pwned"
    evil = tmp_path / "ckpt-e0009-s000000090.npz"
    evil.write_bytes(pickle.dumps(_Payload(str(target))))
    if with_digest:  # even with a matching digest, nothing is unpickled
        import hashlib
        digest = hashlib.sha256(evil.read_bytes()).hexdigest()
        (tmp_path / (evil.name + ".sha256")).write_text(f"{digest}  {evil.name}\n")
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(str(evil))
    assert "not" in str(e.value)
    assert not target.exists()


def test_npz_with_object_array_is_refused(tmp_path):
    import hashlib
    path = tmp_path / "obj.npz"
    np.savez(path, __meta__=np.frombuffer(b'{"format": "hvdtrain-checkpoint", "version": 1, "tree": {"__array__": 0}}',
                                          dtype=np.uint8), a0=np.array([{"x": 1}], dtype=object))
    (tmp_path / "obj.npz.sha256").write_text(hashlib.sha256(path.read_bytes()).hexdigest() + "  obj.npz\n")
    with pytest.raises(ck.CheckpointError):
        ck.load(str(path))
