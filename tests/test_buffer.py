"""The buffer in one process: push, sample, get, views, size, clear, attach, lifecycle, bad input."""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Callable

import numpy as np
import pytest
import torch

import shmbuffer as sb
from shmbuffer.protocol.layout import Counter
from shmbuffer.shm import segment

from .conftest import MUJOCO, copy_through, own_blocks, seq_of, transition

Make = Callable[..., sb.ReplayBuffer]


def block_bytes(buf: sb.ReplayBuffer) -> bytes:
    """Every byte of every column of the block."""
    return b"".join(a.tobytes() for a in buf.block.arrays.values())


def test_push_sample_round_trip(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    ids = buf.push(**transition(0))
    assert ids.tolist() == [0] and len(buf) == 1
    ids = buf.push(transition(1, 9))  # a mapping, k rows
    assert ids.tolist() == list(range(1, 10)) and len(buf) == 10
    batch = buf.sample(64)
    assert len(batch) == 64 and batch.obs is batch["obs"]
    seq = seq_of(batch)
    assert np.array_equal(seq, batch.index)  # row i of this buffer holds sequence number i
    assert set(seq) <= set(range(10))
    assert batch.obs.dtype == np.float32 and batch.done.dtype == np.bool_
    assert batch.keys() == [*MUJOCO.names, "index"] and dict(batch).keys() == {*MUJOCO.names, "index"}


def test_ring_wraps_and_keeps_the_newest(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    assert not buf.full
    for i in range(0, 20, 3):
        buf.push(transition(i, 3))
    assert len(buf) == 8 and buf.full and buf.capacity == 8
    assert seq_of(buf.get(slice(None))).tolist() == list(range(13, 21))
    assert seq_of(buf.sample(200)).min() >= 13
    assert int(buf.get(0).reward) == 13 and int(buf.get(-1).reward) == 20
    assert seq_of(buf.get([0, -1, 3])).tolist() == [13, 20, 16]


def test_get_single_row_has_no_leading_dimension(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(**transition(5))
    row = buf.get(0)
    assert row.obs.shape == (17,) and row.reward.shape == () and int(row.index) == 0
    with pytest.raises(sb.EmptyBufferError, match=r"out of range for 1 row$"):
        buf.get(1)
    with pytest.raises(sb.EmptyBufferError, match="out of range"):
        buf.get(-2)


def test_sample_without_replacement(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=50, name=name, seed=1)
    buf.push(transition(0, 30))
    batch = buf.sample(30, replace=False)
    assert sorted(seq_of(batch)) == list(range(30))
    with pytest.raises(sb.EmptyBufferError, match=r"sample\(31, replace=False\): .* holds only 30 rows"):
        buf.sample(31, replace=False)


def test_sampling_is_uniform(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=16, name=name, seed=0)
    buf.push(transition(0, 16))
    counts = np.bincount(seq_of(buf.sample(160_000)), minlength=16)
    # 10,000 expected per row, sd 97: a bias of a few percent would fail
    assert np.abs(counts - 10_000).max() < 500


@pytest.mark.parametrize("seed", [-1, "a", 1.5, True, [1, -2]], ids=repr)
def test_a_bad_seed_is_refused_with_its_own_error(seed: object, make: Make, name: str) -> None:
    """A seed numpy refuses is refused before the buffer is usable, with numpy's error as the
    cause: no block is left behind, and a buffer attached to is left as it was."""
    match = r"ReplayBuffer: seed: expected an int >= 0, a numpy.random.Generator or None, got"
    before = own_blocks()
    with pytest.raises(ValueError, match=match) as made:
        sb.ReplayBuffer(MUJOCO, 16, name=name + "c", seed=seed)  # type: ignore[arg-type]
    assert own_blocks() == before, "the refused buffer's block was left behind"
    buf = make(MUJOCO, capacity=16, name=name)
    buf.push(transition(0, 4))
    with pytest.raises(ValueError, match=match) as attached:
        sb.ReplayBuffer.attach(buf.handle, seed=seed)  # type: ignore[arg-type]
    if seed is not True:  # numpy takes True for 1: refused before numpy sees it
        assert isinstance(made.value.__cause__, (TypeError, ValueError))
        assert isinstance(attached.value.__cause__, (TypeError, ValueError))
    assert len(buf) == 4 and np.array_equal(buf.export()["reward"], np.arange(4))


def test_seed_makes_sampling_reproducible(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=100, name=name)
    buf.push(transition(0, 100))
    a = sb.ReplayBuffer.attach(buf.handle, seed=7)
    b = sb.ReplayBuffer.attach(buf.handle, seed=7)
    try:
        assert np.array_equal(a.sample(50).index, b.sample(50).index)
        assert np.array_equal(a.sample(50, replace=False).index, b.sample(50, replace=False).index)
    finally:
        a.close()
        b.close()


def test_clear_and_reset(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 5))
    buf.clear()
    assert len(buf) == 0 and not buf.full
    with pytest.raises(sb.EmptyBufferError, match="empty"):
        buf.sample(1)
    ids = buf.push(transition(100, 2))
    assert ids.tolist() == [8, 9]  # ids keep growing, the next row lands in slot 0
    assert seq_of(buf.get(slice(None))).tolist() == [100, 101]
    assert seq_of(buf.view(0, 2)).tolist() == [100, 101]
    with pytest.raises(sb.UnknownName, match=r"'reset' \(MindSpore RL's name\); here: clear\(\)"):
        buf.reset()  # other libraries' names live in their facades (shmbuffer.compat)
    buf.clear()
    assert len(buf) == 0


def test_views_are_zero_copy_and_read_only(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 6))
    view = buf.view(1, 4)
    assert seq_of(view).tolist() == [1, 2, 3] and view.index.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="read-only"):
        view.obs[0, 0] = 1
    buf.push(transition(6, 2))
    col = buf.column("reward")
    assert col.shape == (8,) and col.tolist() == list(range(8))
    buf.push(**transition(8))  # overwrites slot 0: a view is live memory
    assert col[0] == 8 and not col.flags.writeable
    with pytest.raises(ValueError, match="wrap past the end"):
        buf.view(0, 8)
    assert seq_of(buf.view(0, 7)).tolist() == list(range(1, 8))
    with pytest.raises(KeyError, match="no field 'rew'"):
        buf.column("rew")
    tensors = buf.view(0, 3).to()  # zero-copy torch tensors of the shared memory
    assert tensors.reward.tolist() == [1.0, 2.0, 3.0]
    assert tensors.obs.data_ptr() == buf.column("obs")[1:].__array_interface__["data"][0]
    del view, col, tensors


def test_batch_to_torch(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=32, name=name)
    buf.push(transition(0, 32))
    batch = buf.sample(16)
    t = batch.to("cpu")
    assert isinstance(t.obs, torch.Tensor) and t.obs.dtype == torch.float32 and t.done.dtype == torch.bool
    assert t.reward.shape == (16,) and t.obs.shape == (16, 17) and t.index.dtype == torch.int64
    for field in MUJOCO.names:
        assert np.array_equal(t[field].numpy(), batch[field])
    assert np.array_equal(t.numpy().obs, batch.obs)


def test_images_keep_their_own_column(make: Make, name: str) -> None:
    schema = sb.Schema(obs=((4, 84, 84), "uint8"), action=((), "int64"), reward=((), "float32"))
    assert [f.name for f in schema.columns] == ["obs"]
    buf = make(schema, capacity=16, name=name)
    for i in range(20):
        buf.push(obs=np.full((4, 84, 84), i, np.uint8), action=i, reward=float(i))
    batch = buf.sample(64)
    assert np.array_equal(batch.obs[:, 0, 0, 0], batch.action)
    assert np.all(batch.obs == batch.action[:, None, None, None].astype(np.uint8))
    t = batch.to()
    assert t.obs.shape == (64, 4, 84, 84) and torch.equal(t.action, torch.from_numpy(batch.action))


def test_lanes(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=12, lanes=3, name=name)
    assert buf.lane_capacity == 4
    buf.push(transition(0, 3), lane=0)
    buf.push(transition(100, 4), lane=2)
    buf.push(transition(104, 2), lane=2)  # wraps inside lane 2, which keeps its newest 4
    buf.push(transition(200, 3), lane=[1, 1, 0])  # one row each into lanes 1, 1, 0
    assert len(buf) == 3 + 1 + 4 + 2
    assert seq_of(buf.view(0, 4, lane=0)).tolist() == [0, 1, 2, 202]
    assert seq_of(buf.view(0, 2, lane=1)).tolist() == [200, 201]
    assert seq_of(buf.get(slice(None))).tolist() == [0, 1, 2, 202, 200, 201, 102, 103, 104, 105]
    lanes = buf.get(slice(None)).index % 3
    assert lanes.tolist() == [0] * 4 + [1] * 2 + [2] * 4
    assert set(seq_of(buf.sample(500))) == {0, 1, 2, 202, 200, 201, 102, 103, 104, 105}
    with pytest.raises(sb.CapacityError, match="larger than a lane's capacity"):
        buf.push(transition(0, 5), lane=1)
    with pytest.raises(sb.CapacityError, match=r"expected a lane in \[0, 3\), got 3"):
        buf.push(**transition(0), lane=3)
    buf.clear()
    assert len(buf) == 0


def test_bad_input_leaves_the_buffer_exactly_as_it_was(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    buf.push(transition(0, 5))
    before = block_bytes(buf)
    bad = []
    for field, value in [("obs", np.zeros((2, 16), np.float32)), ("done", np.full(2, 2)), ("action", np.zeros((3, 6)))]:
        data = transition(0, 2)
        data[field] = value
        bad.append(data)
    missing = transition(0, 2)
    del missing["next_obs"]
    bad += [missing, {**transition(0, 2), "extra": np.zeros(2)}]
    for data in bad:
        with pytest.raises(sb.FieldError):
            buf.push(data)
    with pytest.raises(sb.CapacityError, match="larger than the buffer's capacity of 8 rows"):
        buf.push(transition(0, 9))
    with pytest.raises(TypeError, match="mapping or keyword fields, not both"):
        buf.push(transition(0, 1), reward=1.0)
    with pytest.raises(ValueError, match="positive number of rows"):
        buf.sample(0)
    with pytest.raises(sb.EmptyBufferError):
        buf.sample(6, replace=False)
    assert block_bytes(buf) == before
    assert len(buf.push({k: v[:0] for k, v in transition(0, 1).items()})) == 0
    assert block_bytes(buf) == before


def test_empty_buffer_errors(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name)
    with pytest.raises(sb.EmptyBufferError, match=rf"sample\(4\): buffer '{name}' is empty"):
        buf.sample(4)
    with pytest.raises(sb.EmptyBufferError, match="out of range for 0 rows"):
        buf.get(0)


def test_constructor_errors(name: str) -> None:
    with pytest.raises(ValueError, match="capacity: expected a positive int, got 0"):
        sb.ReplayBuffer(MUJOCO, 0, name=name)
    with pytest.raises(ValueError, match="lanes: expected a positive divisor of capacity 10, got 3"):
        sb.ReplayBuffer(MUJOCO, 10, lanes=3, name=name)
    with pytest.raises(ValueError, match="buffer name 'a/b'"):
        sb.ReplayBuffer(MUJOCO, 10, name="a/b")
    with pytest.raises(sb.SchemaError, match="expected a Schema or a cpprb-style env_dict"):
        sb.ReplayBuffer([1, 2], 10, name=name)  # type: ignore[arg-type]


def test_env_dict_buffer(make: Make, name: str) -> None:
    buf = make({"obs": {"shape": (4,)}, "act": {"dtype": np.int64}, "rew": {}}, capacity=10, name=name)
    buf.push(obs=np.ones(4), act=[2], rew=[0.5])
    batch = buf.sample(2)
    assert batch.rew.shape == (2, 1) and batch.act.tolist() == [[2], [2]]


# -- identity, attach and lifecycle --------------------------------------------------------------


def test_attach_by_handle_and_by_name(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    buf.push(transition(0, 4))
    for held, key in [(4, buf.handle), (5, name)]:
        other = sb.ReplayBuffer.attach(key, schema=MUJOCO)
        try:
            assert len(other) == held and other.schema == MUJOCO and not other.owner
            other.push(**transition(4))
        finally:
            other.close()
    assert len(buf) == 6 and seq_of(buf.get(-1)).tolist() == 4


def test_attach_errors(make: Make, name: str) -> None:
    with pytest.raises(sb.SegmentNotFound, match=f"no buffer named '{name}'"):
        sb.ReplayBuffer.attach(name)
    buf = make(MUJOCO, capacity=10, name=name)
    other = sb.Schema(obs=((17,), "float64"))
    with pytest.raises(sb.SchemaError, match="expected Schema"):
        sb.ReplayBuffer.attach(buf.handle, schema=other)


def test_handle_is_small_and_independent_of_capacity(make: Make, name: str) -> None:
    small = make(MUJOCO, capacity=10, name=name + "s")
    big = make(MUJOCO, capacity=1_000_000, name=name + "b")  # same name length, 100,000x the rows
    assert len(pickle.dumps(small.handle)) == len(pickle.dumps(big.handle)) < 200
    assert len(pickle.dumps(small)) == len(pickle.dumps(big)) < 300  # a buffer pickles as its handle
    clone = pickle.loads(pickle.dumps(small))
    try:
        assert clone.name == small.name and not clone.owner and len(clone) == 0
    finally:
        clone.close()


def test_a_subclass_attaches_as_itself_and_pickles_as_a_replay_buffer(name: str) -> None:
    """``attach`` and ``load`` build the class they are called on; a pickle (a spawned worker's
    argument) names no class, so even a local subclass crosses and attaches a ``ReplayBuffer``."""

    class Mine(sb.ReplayBuffer):
        pass

    with Mine(MUJOCO, capacity=10, name=name) as buf:
        buf.push(**transition(0))  # the C push is seated on a subclass that keeps the method
        with Mine.attach(name) as same, pickle.loads(pickle.dumps(buf)) as clone:
            assert type(same) is Mine and type(clone) is sb.ReplayBuffer
            clone.push(**transition(1))
            assert len(same) == 2 and not clone.owner and seq_of(same.get(-1)).tolist() == 1
        assert same.closed and clone.closed and not buf.closed


def test_close_and_unlink_are_idempotent(name: str) -> None:
    buf = sb.ReplayBuffer(MUJOCO, capacity=10, name=name)
    path = segment.path_of(name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    buf.close()
    buf.close()
    assert os.path.exists(path)  # closing does not remove the name
    buf.unlink()
    buf.unlink()
    assert not os.path.exists(path)
    with pytest.raises(sb.ClosedError, match="closed"):
        buf.push(**transition(0))
    with pytest.raises(sb.ClosedError):
        len(buf)


def test_context_manager(name: str) -> None:
    with sb.ReplayBuffer(MUJOCO, capacity=10, name=name) as buf:
        buf.push(**transition(0))
        with sb.ReplayBuffer.attach(name) as other:
            assert len(other) == 1
        assert os.path.exists(segment.path_of(name))  # an attacher never unlinks
    assert not os.path.exists(segment.path_of(name))


def test_close_refuses_while_views_live(name: str) -> None:
    buf = sb.ReplayBuffer(MUJOCO, capacity=10, name=name)
    buf.push(**transition(0))
    view = buf.column("obs")
    with pytest.raises(BufferError, match="still alive"):
        buf.close()
    del view
    buf.close()
    buf.unlink()


def test_close_in_a_finally_block_lets_the_error_through(name: str) -> None:
    """``close()`` in a ``finally`` after a refused push: the push's error comes out, not a
    ``BufferError`` for the internals its traceback holds; the mapping goes with them."""
    schema = sb.Schema(obs=((3,), "float32"), next_obs=((3,), "float32"), done=((), "bool"))
    buf = sb.ReplayBuffer(schema, 10, name=name, next_of="obs")
    with pytest.raises(sb.FieldError, match="does not continue"):
        try:
            buf.push(obs=np.zeros(3), next_obs=np.ones(3), done=False)
            buf.push(obs=np.full(3, 5.0), next_obs=np.ones(3), done=False)
        finally:
            buf.close()
            buf.unlink()
    assert buf.closed and not os.path.exists(segment.path_of(name))


def test_dropping_the_creator_unlinks(name: str) -> None:
    buf = sb.ReplayBuffer(MUJOCO, capacity=10, name=name)
    del buf
    assert not os.path.exists(segment.path_of(name))


def test_existing_name_is_refused(make: Make, name: str) -> None:
    make(MUJOCO, capacity=10, name=name)
    with pytest.raises(FileExistsError, match=f"a buffer named '{name}' already exists .*alive"):
        sb.ReplayBuffer(MUJOCO, capacity=10, name=name)


def test_stats(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(sb.CapacityError):
        buf.push(transition(0, 12))
    buf.push(transition(0, 7))
    buf.sample(5)
    buf.sample(3)
    assert buf.stats == {"inserted": 7, "sampled": 8, "reclaimed": 0, "lock_recoveries": 0}


def test_context_exit_with_live_views(name: str) -> None:
    with sb.ReplayBuffer(MUJOCO, capacity=10, name=name) as buf:
        buf.push(transition(0, 3))
        view = buf.view(0, 3)
    assert buf.closed and not os.path.exists(segment.path_of(name))
    assert seq_of(view).tolist() == [0, 1, 2]  # the mapping lives as long as the view
    del view


def test_torch_views_of_the_record_match_numpy() -> None:
    """The device path's views of the packed block (checked here on CPU tensors)."""
    from shmbuffer.batch import torch_views

    schema = sb.Schema(a=((3,), "bool"), b=((), "float64"), c=((5,), "int16"), d=((2, 3), "float32"),
                       e=((), "complex128"), f=((2,), "uint8"))
    rec = schema.record
    assert rec.itemsize % 16 == 0
    block = np.random.default_rng(0).integers(0, 255, (7, rec.itemsize), dtype=np.uint8)
    want = rec.views(block)
    for offset_rows in (0, 2):  # also a block that starts inside a larger tensor
        got = torch_views(torch.from_numpy(block)[offset_rows:], rec)
        for name in schema.names:
            assert got[name].dtype == torch.from_numpy(want[name][:1].copy()).dtype
            assert np.array_equal(got[name].numpy(), want[name][offset_rows:], equal_nan=name in "bde"), name


def test_take_rows_by_id(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, lanes=2, name=name)
    buf.push(transition(0, 4), lane=0)
    buf.push(transition(10, 4), lane=1)
    batch = buf.sample(6)
    again = buf.take(batch.index)
    assert np.array_equal(seq_of(again), seq_of(batch)) and np.array_equal(again.index, batch.index)
    buf.push(transition(20, 2), lane=0)  # overwrites lane 0's two oldest rows (ids 0 and 2)
    with pytest.raises(sb.EmptyBufferError, match=r"take: 2 of 3 rows are no longer .*ids \[0, 2\]"):
        buf.take([0, 2, 4])
    with pytest.raises(sb.EmptyBufferError):
        buf.take([-1])
    assert seq_of(buf.take(torch.tensor([1, 4]))).tolist() == [10, 2]


def test_loader_method(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=32, name=name)
    buf.push(transition(0, 32))
    with buf.loader(8, batches=2) as loader:
        assert [b.obs.shape for b in loader] == [torch.Size([8, 17])] * 2


def test_a_copy_that_fails_gives_the_rows_back(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=8, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))
    armed = [True]

    def stop_at_done(field: str) -> None:
        if armed[0] and field == "done":
            armed[0] = False  # once: the copy puts back what it wrote through the same columns
            raise KeyboardInterrupt

    copy_through(buf, stop_at_done)
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(4, 2))  # stopped midway into empty slots: the ring is put back as it was
    armed[0] = False
    assert len(buf) == 4 and buf.stats["inserted"] == 4
    assert set(seq_of(buf.sample(100))) == {0, 1, 2, 3}
    assert buf.priorities.tree.leaves[4:6].tolist() == [0.0, 0.0]  # type: ignore[union-attr]
    with pytest.raises(sb.EmptyBufferError, match="out of range"):
        buf.get(5)
    buf.push(transition(4, 6))  # a full ring
    before = {k: v.copy() for k, v in buf.block.arrays.items() if k != "_mutex"}
    armed[0] = True
    with pytest.raises(KeyboardInterrupt):
        buf.push(transition(10, 2))  # stopped midway over rows 2 and 3: their bytes are put back
    armed[0] = False
    assert all(np.array_equal(v, before[k]) for k, v in buf.block.arrays.items()
               if k not in ("_mutex", "_owner", "_stats", "_edits"))
    edits = int(buf.block.counters[Counter.EDITS])  # both put-backs are logged, before and after their stamps
    assert edits == 8 and buf.block.arrays["_edits"][:edits].tolist() == [4, 5, 4, 5, 2, 3, 2, 3]
    assert len(buf) == 8 and buf.stats["inserted"] == 10
    assert seq_of(buf.get(slice(None))).tolist() == list(range(2, 10))
    other = sb.ReplayBuffer.attach(buf.handle)  # a writer that reserved after the failed push: that push's rows
    res = buf.ring.reserve(2, deferring=False)  # can no longer be given back; they are holes, never torn
    other.push(transition(12, 1))
    buf.ring.undo(res, copied=False)
    other.close()
    assert len(buf) == 6 and set(seq_of(buf.sample(100))) == {5, 6, 7, 8, 9, 12}  # the holes are not counted
    with pytest.raises(sb.EmptyBufferError, match=r"lost: .*its push failed after another writer"):
        buf.take(res.ids[-1:])


def test_take_refuses_ids_that_never_existed(make: Make, name: str) -> None:
    """A huge id's stamp 2 * id + 2 wraps to 0, an empty slot's: it must never be read."""
    buf = make(MUJOCO, capacity=10, lanes=2, name=name)
    buf.push(transition(0, 5), lane=0)  # ids 0 2 4 6 8
    buf.push(transition(5, 2), lane=1)  # ids 1 3
    for ids, shown in [([2**63 - 1], r"\[9223372036854775807\]"), ([-1], r"\[-1\]"), ([0, 5, 10], r"\[5, 10\]"),
                       ([-(2**63)], r"\[-9223372036854775808\]"), (np.array([2**63], np.uint64), r"\[9223372036854775808\]")]:
        with pytest.raises(sb.FieldError, match=rf"take: ids {shown} never named a row of this buffer"):
            buf.take(ids)
    for ids in (np.array([0.0]), [0.5], [True]):
        with pytest.raises(sb.FieldError, match=r"take: expected integer row ids \(batch.index\), got dtype"):
            buf.take(ids)
    buf.push(transition(10, 5), lane=0)  # lane 0 laps: ids 0..8 are overwritten, which is not unknown
    with pytest.raises(sb.EmptyBufferError, match="no longer in buffer") as gone:
        buf.take([0, 3])
    assert not isinstance(gone.value, sb.FieldError)
    assert seq_of(buf.take(np.array([10, 3], np.uint8))).tolist() == [10, 6]


@pytest.mark.parametrize("one_call", [True, False])
def test_sample_out_is_checked_and_may_be_partial(one_call: bool, make: Callable[..., sb.ReplayBuffer], name: str) -> None:
    """``sample(n, out=)``: any of the batch's arrays (the others made), each checked before
    anything is read: a clear ``FieldError`` for an unknown key, a wrong shape or dtype, a
    read-only array or not an array, on the C path and the Python path alike."""
    schema = sb.Schema(obs=((4,), "float32"), img=((3, 84, 84), "uint8"), a=((), "int64"))
    buf = make(schema, 64, name=name)
    buf._paths.one_calls = one_call
    buf.push(obs=np.ones((20, 4)), img=np.full((20, 3, 84, 84), 7, np.uint8), a=np.arange(20))
    first = buf.sample(8)
    block, img = np.empty_like(first.block), np.empty_like(first.img)
    for out in ({}, {"_block": block}, {"img": img}, {"_block": block, "img": img}):
        got = buf.sample(8, out=out)
        assert (got.img == 7).all() and np.array_equal(got.a, got.index) and (got.obs == 1).all()
        assert all(np.shares_memory(got.block if k == "_block" else got[k], a) for k, a in out.items())
    ro = np.empty_like(img)
    ro.flags.writeable = False
    bad = {
        "unknown": ({"foo": img}, r"expected a dict of any of \{'_block': \(8, \d+\) uint8, 'img': \(8, 3, 84, 84\) uint8\}.*got \['foo'\]"),
        "dtype": ({"_block": block.view(np.int8)}, r"out\['_block'\]: expected \(8, \d+\) uint8, got \(8, \d+\) int8"),
        "shape": ({"img": img[:4]}, r"out\['img'\]: expected \(8, 3, 84, 84\) uint8, got \(4, 3, 84, 84\) uint8"),
        "read-only": ({"img": ro}, r"out\['img'\] is read-only"),
        "tensor": ({"img": torch.from_numpy(img)}, r"must be a numpy array .*tensor\.numpy\(\)"),
        "not a dict": ([img], r"got a list"),
    }
    for out, message in bad.values():
        with pytest.raises(sb.FieldError, match=message):
            buf.sample(8, out=out)  # type: ignore[arg-type]
