"""shmbuffer.torchrl: a TorchRL Storage whose rows live in a shmbuffer. The contract is TorchRL's
storage one: its ReplayBuffer, samplers and writers work on it, set/get/len/state_dict behave as
for LazyTensorStorage; and writers in other processes lose or tear no row."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch

pytest.importorskip("torchrl")
from tensordict import TensorDict, tensorclass
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement

from shmbuffer import CapacityError, FieldError
from shmbuffer.shm import segment
from shmbuffer.tensordicts import class_name
from shmbuffer.torchrl import ShmStorage, identity

from .conftest import own_blocks

ROOT = Path(__file__).resolve().parent.parent



def rows(start: int, k: int) -> TensorDict:
    """``k`` self-verifying rows: every value derives from the row's sequence number."""
    seq = torch.arange(start, start + k)
    return TensorDict({"obs": seq[:, None].float() + torch.arange(4.0), "action": seq, "next": {"obs": seq[:, None].float() + 1}},
                      batch_size=[k])


def check(td: TensorDict) -> torch.Tensor:
    seq = td["action"]
    assert torch.equal(td["obs"], seq[:, None].float() + torch.arange(4.0))
    assert torch.equal(td["next", "obs"], seq[:, None].float() + 1)
    return seq


@pytest.fixture
def storages() -> Iterator[list[ShmStorage]]:
    made: list[ShmStorage] = []
    yield made
    for s in made:
        s.close()


def test_matches_lazy_tensor_storage(name: str, storages: list[ShmStorage]) -> None:
    """The same extends into TorchRL's LazyTensorStorage and ours hold the same rows in the same
    slots (wrapping included), so any sampler's indices give the same rows."""
    ours = ShmStorage(10, name=name)
    storages.append(ours)
    theirs = LazyTensorStorage(10)
    rb_ours = ReplayBuffer(storage=ours, collate_fn=identity)
    rb_theirs = ReplayBuffer(storage=theirs)
    for start, k in [(0, 3), (3, 4), (7, 1), (8, 5), (13, 2)]:  # 15 rows into 10 slots
        assert rb_ours.extend(rows(start, k)).tolist() == rb_theirs.extend(rows(start, k)).tolist()
        assert len(ours) == len(theirs)
    index = torch.tensor([0, 9, 3, 3, 5])
    got, expected = ours.get(index), theirs.get(index)
    assert torch.equal(got["action"], expected["action"]) and torch.equal(got["next", "obs"], expected["next", "obs"])
    check(got)
    assert set(check(ours.get(slice(None))).tolist()) == set(range(5, 15))
    one = ours.get(4)
    assert one.batch_size == torch.Size([]) and one["action"] == theirs.get(4)["action"]
    assert ours.contains(9) and not ours.contains(10)
    with pytest.raises(IndexError):
        ours.get(torch.tensor([10]))


@pytest.mark.parametrize("sampler", [RandomSampler, SamplerWithoutReplacement])
def test_torchrl_samplers_on_it(sampler: Any, name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(64, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, sampler=sampler(), collate_fn=identity, batch_size=16)
    rb.extend(rows(0, 48))  # whole batches: without replacement, an epoch's last batch is short
    seen = set()
    for _ in range(5):
        batch = rb.sample()
        assert batch.batch_size == torch.Size([16])
        seen |= set(check(batch).tolist())
    assert seen <= set(range(48)) and len(seen) > 16


def test_add_single_rows_and_state_dict(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, collate_fn=identity)
    for i in range(3):
        rb.add(rows(i, 1)[0])
    assert len(storage) == 3 and check(storage.get(slice(None))).tolist() == [0, 1, 2]
    state = storage.state_dict()
    copy = ShmStorage(8, name=name + "c")
    storages.append(copy)
    copy.load_state_dict(state)
    assert check(copy.get(slice(None))).tolist() == [0, 1, 2]
    rb.empty()
    assert len(storage) == 0


def test_a_state_that_load_state_dict_refuses_leaves_the_rows(name: str, storages: list[ShmStorage]) -> None:
    """The rows of a state are checked before the storage's rows are replaced: a state it refuses
    (too many rows, a field missing) raises and the storage keeps its rows."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(5), rows(0, 5))
    state = storage.state_dict()
    big = {**state, "rows": {n: np.concatenate([a, a]) for n, a in state["rows"].items()}}
    with pytest.raises(CapacityError):
        storage.load_state_dict(big)
    missing = {**state, "rows": {n: a for n, a in state["rows"].items() if n != "action"}}
    with pytest.raises(FieldError, match="missing field 'action'"):
        storage.load_state_dict(missing)
    assert len(storage) == 5 and check(storage.get(slice(None))).tolist() == [0, 1, 2, 3, 4]
    storage.load_state_dict(state)
    assert check(storage.get(slice(None))).tolist() == [0, 1, 2, 3, 4]


def test_a_state_naming_a_class_that_is_no_tensorclass_is_refused(name: str, storages: list[ShmStorage]) -> None:
    """The tensorclass a state (or a dump's metadata) names is imported by name: anything but a
    tensorclass is refused at the load, not called at the first get."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(2), rows(0, 2))
    state = {**storage.state_dict(), "kind": "tensorclass", "tensorclass": {"": "os:system"}}
    fresh = ShmStorage(8, name=name + "c")
    storages.append(fresh)
    with pytest.raises(TypeError, match="os:system as their tensorclass, which is a builtin_function_or_method"):
        fresh.load_state_dict(state)
    assert fresh.buffer is None


PAYLOAD = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")

class Evil:
    pass
"""


@pytest.mark.parametrize("module", ["payload", "d.payload"])  # beside the dump, and inside it
def test_loads_never_imports_what_a_dump_names(module: str, name: str, storages: list[ShmStorage], tmp_path: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A dump's torchrl.json names the tensorclass of its rows; a tampered one naming a module
    beside the dump (importable: the working directory on sys.path, as in ``python -c`` or a
    notebook) is refused, and the module's code never runs."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(3), _outer(3))
    storage.dumps(tmp_path / "d")
    marker = tmp_path / "ran"
    for where in (tmp_path, tmp_path / "d"):
        (where / "payload.py").write_text(PAYLOAD.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    meta = tmp_path / "d" / "torchrl.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "tensorclass": {"": f"{module}:Evil", "nxt": f"{module}:Evil"}}))
    fresh = ShmStorage(8, name=name + "c")
    storages.append(fresh)
    before = own_blocks()
    with pytest.raises(TypeError) as refused:
        fresh.loads(tmp_path / "d")
    assert not marker.exists() and module not in sys.modules, "loads ran the module the dump named"
    assert f"tensorclass '{module}:Evil', which is not among the modules imported here" in str(refused.value)
    assert fresh.buffer is None and own_blocks() == before
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "tensorclass": {"": class_name(Outer), "nxt": class_name(Inner)}}))
    fresh.loads(tmp_path / "d")
    assert type(fresh.get(slice(None))) is Outer and not marker.exists()


@pytest.mark.parametrize("kind", ["evil", ["tensorclass"], 3])
def test_a_tampered_kind_is_refused_before_anything_is_read(kind: Any, name: str, storages: list[ShmStorage],
                                                            tmp_path: Any) -> None:
    """A dump whose torchrl.json says another kind is refused for that, before its rows are read."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(3), rows(0, 3))
    storage.dumps(tmp_path / "d")
    (tmp_path / "d" / "torchrl.json").write_text(json.dumps({"kind": kind, "tensorclass": {"": "payload:Evil"}}))
    (tmp_path / "d" / "rows.safetensors").write_bytes(b"not rows")  # the kind is refused before the rows are read
    fresh = ShmStorage(8, name=name + "c")
    storages.append(fresh)
    before = own_blocks()
    with pytest.raises(Exception) as refused:
        fresh.loads(tmp_path / "d")
    assert refused.type is ValueError and "expected a kind in" in str(refused.value), f"not the kind: {refused.value!r}"
    assert fresh.buffer is None and own_blocks() == before


def _writer(shared: Any, start: int, pushes: int, k: int) -> None:
    rb = shared if isinstance(shared, ReplayBuffer) else ReplayBuffer(storage=shared, collate_fn=identity)
    for p in range(pushes):
        rb.extend(rows(start + p * k, k))
    rb.storage.buffer.close()


@pytest.mark.parametrize("via", ["storage", "replay_buffer"])
def test_writers_in_other_processes_lose_and_tear_nothing(via: str, name: str, storages: list[ShmStorage],
                                                          procs: list[Any]) -> None:
    """Two processes extend the same storage at once, with a round-robin writer each (the storage
    pickled: their own cursors, which collide) or with copies of one ReplayBuffer (TorchRL's
    shared cursor, unordered between them): every row of both is there, whole, once."""
    storage = ShmStorage(4000, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage)
    rb.extend(rows(100_000, 1))  # creates the shared buffer before it travels
    ctx = mp.get_context("spawn")
    for start in (0, 10_000):
        procs.append(ctx.Process(target=_writer, args=(storage if via == "storage" else rb, start, 150, 8)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    seq = check(storage.get(slice(None)))
    assert len(storage) == 1 + 2 * 150 * 8
    assert sorted(seq.tolist()) == [*range(1200), *range(10_000, 11_200), 100_000]


@pytest.mark.parametrize("kind", ["tensordict", "tensor", "ndim2"])
def test_samples_are_contiguous_tensors(kind: str, name: str, storages: list[ShmStorage]) -> None:
    """What a sample and a get give are contiguous tensors, as from LazyTensorStorage (the small
    fields of a row are gathered as one packed record: they were strided views of it, and
    ``sample["observation"].view(-1)`` raised)."""
    storage = ShmStorage(64, name=name, ndim=2 if kind == "ndim2" else 1)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, batch_size=8)
    data = TensorDict({"observation": torch.randn(40, 22), "action": torch.arange(40), "reward": torch.randn(40, 1),
                       "next": {"observation": torch.randn(40, 22), "done": torch.zeros(40, 1, dtype=torch.bool)}}, [40])
    rb.extend(data if kind == "tensordict" else data["observation"] if kind == "tensor" else data.reshape(2, 20))
    for got in (rb.sample(), storage.get(torch.tensor([3, 1, 2])), storage.get(slice(None)), storage.get(5)):
        leaves = [got] if isinstance(got, torch.Tensor) else [got.get(k) for k in got.keys(True, True)]
        assert all(t.is_contiguous() for t in leaves), [t.stride() for t in leaves]
    obs = rb.sample()
    obs = obs if kind == "tensor" else obs["observation"]
    assert obs.view(-1).shape == (8 * 22,)


def test_dumps_and_loads_and_tensordict_replay_buffer(name: str, storages: list[ShmStorage], tmp_path: Any) -> None:
    from torchrl.data import TensorDictReplayBuffer

    storage = ShmStorage(16, name=name)
    storages.append(storage)
    rb = TensorDictReplayBuffer(storage=storage, collate_fn=identity, batch_size=4)
    rb.extend(rows(0, 10))
    batch = rb.sample()
    assert torch.equal(storage.get(batch["index"])["action"], batch["action"])  # the sampled slots' rows
    check(batch)
    storage.dumps(tmp_path / "s")
    other = ShmStorage(16, name=name + "o")
    storages.append(other)
    other.loads(tmp_path / "s")
    assert check(other.get(slice(None))).tolist() == list(range(10))
    assert other.get(slice(None))["next", "obs"].shape == (10, 1)


# -- TorchRL's Storage contract, as its own test/rb/test_storages.py exposed it ------------------
def _rb(storage: Any, **kwargs: Any) -> ReplayBuffer:
    return ReplayBuffer(storage=storage, **kwargs)


def test_writes_at_indices_overwrite_those_slots(name: str, storages: list[ShmStorage]) -> None:
    """``rb[3:4] = td`` overwrites slot 3 (it appended a row at slot 100 and left slot 3 as it was);
    after a wrap an index is still the physical slot, as in LazyTensorStorage."""
    ours, theirs = ShmStorage(102, name=name), LazyTensorStorage(102)
    storages.append(ours)
    rbs = [_rb(ours), _rb(theirs)]
    for rb in rbs:
        rb.extend(TensorDict({"a": torch.arange(100), ("b", "c"): torch.arange(100)}, [100]))
        rb[3:4] = TensorDict({"a": torch.tensor([-1]), ("b", "c"): torch.tensor([-2])}, [1])
        rb[torch.tensor([30, 10, 30])] = TensorDict({"a": torch.tensor([-3, -4, -5]), ("b", "c"): torch.zeros(3, dtype=torch.long)}, [3])
        rb.extend(TensorDict({"a": torch.arange(100, 105), ("b", "c"): torch.arange(100, 105)}, [5]))  # wraps: slots 100, 101, 0, 1, 2
        rb[1] = TensorDict({"a": torch.tensor(-6), ("b", "c"): torch.tensor(-6)}, [])
    assert len(ours) == len(theirs) == 102
    assert rbs[0].writer._cursor == rbs[1].writer._cursor == 3
    got, expected = ours.get(torch.arange(102)), theirs.get(torch.arange(102))
    assert torch.equal(got["a"], expected["a"]) and torch.equal(got["b", "c"], expected["b", "c"])
    assert got["a"][[0, 1, 2, 3, 10, 30]].tolist() == [102, -6, 104, -1, -4, -5]


def test_set_at_held_slots_overwrites_and_next_slots_append(name: str, storages: list[ShmStorage]) -> None:
    """A writer's ``set(cursor, data)`` at held slots (TorchRL's max-value writer, a reloaded
    cursor) overwrites them; a write spanning the held rows and the next empty slots does both."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(4), torch.arange(4))
    storage.set(torch.tensor([2, 0]), torch.tensor([20, 10]))
    assert storage.get(slice(None)).tolist() == [10, 1, 20, 3] and len(storage) == 4
    storage[torch.tensor([3, 4, 5])] = torch.tensor([30, 40, 50])
    assert storage.get(slice(None)).tolist() == [10, 1, 20, 30, 40, 50] and len(storage) == 6


def test_a_write_at_empty_slots_that_are_not_next_is_refused(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    with pytest.raises(IndexError, match="storage is empty"):
        storage.set(range(2, 4), torch.arange(2))
    assert storage.buffer is None  # nothing created on a refused first write
    storage.set(range(3), torch.arange(3))
    with pytest.raises(IndexError, match=r"slots \[5, 6\] hold no row and are not the next ones"):
        storage[torch.tensor([1, 5, 6])] = torch.tensor([-1, -5, -6])
    assert storage.get(slice(None)).tolist() == [0, 1, 2]  # the held row 1 was not written either


@pytest.mark.parametrize("start", [0, 7])
def test_extend_past_max_size_wraps_keeping_the_newest(start: int, name: str, storages: list[ShmStorage]) -> None:
    """One extend of more rows than max_size (it raised CapacityError) keeps the newest in the
    slots TorchRL's writer gives them."""
    ours, theirs = ShmStorage(10, name=name), LazyTensorStorage(10)
    storages.append(ours)
    for rb in (_rb(ours), _rb(theirs)):
        if start:
            rb.extend(torch.arange(start))
        rb.extend(torch.arange(100, 125))
    assert ours.get(torch.arange(10)).tolist() == theirs.get(torch.arange(10)).tolist()
    assert sorted(ours.get(slice(None)).tolist()) == list(range(115, 125))


def test_a_second_dumps_writes_only_the_new_rows(name: str, storages: list[ShmStorage], tmp_path: Any) -> None:
    """``dumps`` is a checkpoint: a second one into the same directory writes only the rows added
    since (a chunk of its own, the first one kept), and ``loads`` reads the last one."""
    ours = ShmStorage(1000, name=name)
    storages.append(ours)
    rb = _rb(ours)
    rb.extend(TensorDict({"a": torch.arange(600)}, [600]))
    ours.dumps(tmp_path / "d")
    rb.extend(TensorDict({"a": torch.arange(600, 603)}, [3]))
    ours.dumps(tmp_path / "d")
    chunks = sorted(p.name for p in (tmp_path / "d").iterdir() if p.name.startswith("chunk-"))
    assert chunks == ["chunk-00000001.safetensors", "chunk-00000002.safetensors"]
    assert (tmp_path / "d" / chunks[1]).stat().st_size < (tmp_path / "d" / chunks[0]).stat().st_size / 4
    back = ShmStorage(1000, name=name + "b")
    storages.append(back)
    back.loads(tmp_path / "d")
    assert back.get(torch.arange(603))["a"].tolist() == list(range(603))


def test_dumps_twice_and_loads_puts_rows_back_in_their_slots(name: str, storages: list[ShmStorage], tmp_path: Any) -> None:
    """``dumps`` twice into one directory replaces the dump (it raised FileExistsError); a wrapped
    storage loads with every row in its slot, so the restored writer goes on as TorchRL's does."""
    ours, theirs = ShmStorage(10, name=name), LazyTensorStorage(10)
    storages.append(ours)
    rb_ours, rb_theirs = _rb(ours), _rb(theirs)
    for rb in (rb_ours, rb_theirs):
        rb.extend(TensorDict({"a": torch.arange(13)}, [13]))  # slots 0..2 hold 10..12
    ours.dumps(tmp_path / "d")
    rb_ours.extend(TensorDict({"a": torch.arange(20, 22)}, [2]))
    ours.dumps(tmp_path / "d")  # the second dump replaces the first
    rb_theirs.extend(TensorDict({"a": torch.arange(20, 22)}, [2]))
    back = ShmStorage(10, name=name + "b")
    storages.append(back)
    back.loads(tmp_path / "d")
    assert back.get(torch.arange(10))["a"].tolist() == theirs.get(torch.arange(10))["a"].tolist()
    state = rb_ours.state_dict()
    again = ShmStorage(10, name=name + "s")
    storages.append(again)
    rb_again = _rb(again)
    rb_again.load_state_dict(state)
    for rb in (rb_again, rb_theirs):
        rb.extend(TensorDict({"a": torch.arange(30, 33)}, [3]))
    assert again.get(torch.arange(10))["a"].tolist() == theirs.get(torch.arange(10))["a"].tolist()


def test_base_storage_arguments_are_accepted(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(8, name=name, compilable=True, checkpointer=None)
    storages.append(storage)
    storage.set(range(3), torch.arange(3))
    assert storage._last_cursor_index == 2 and storage.get(slice(None)).tolist() == [0, 1, 2]


def test_ndim3_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"ndim=3 .*reshape\(-1\).*LazyTensorStorage"):
        ShmStorage(8, ndim=3)


def test_shared_init_is_accepted_and_the_first_write_anywhere_makes_it(name: str, storages: list[ShmStorage],
                                                                        procs: list[Any]) -> None:
    """``shared_init=True`` (TorchRL's examples pass it) is accepted, and every ShmStorage is made
    by its first write in whichever process: a copy pickled while empty writes first, with a key
    the original never saw, and the original then reads those rows, owns the block and removes it."""
    storage = ShmStorage(16, name=name, shared_init=True)
    storages.append(storage)
    assert storage.shared_init and not storage.initialized
    ctx = mp.get_context("spawn")
    procs.append(ctx.Process(target=_writer, args=(storage, 0, 2, 3)))
    procs[0].start()
    procs[0].join(120)
    assert procs[0].exitcode == 0
    assert storage.initialized and check(storage.get(slice(None))).tolist() == list(range(6))
    assert storage.buffer is not None and storage.buffer.owner  # the writer gave it up, this object took it over
    storage.close()
    assert not [n for n in segment.list_names() if n.startswith(name)]


def _collect(collector: str, shared_init: bool) -> None:
    """Run by ``test_collectors_whose_workers_add_keys``: a multi-process collector whose workers
    add a step count (``max_frames_per_traj``) fills a ShmStorage. No policy of weights: with one,
    torchrl 0.14.1's weight-sync scheme hangs this process at exit when the collector lived in a
    function, whatever the storage (LazyTensorStorage too: its ``__del__`` starts a queue's thread
    during interpreter shutdown)."""
    import functools

    import torchrl.collectors as collectors

    storage = ShmStorage(2000, shared_init=True) if shared_init else ShmStorage(2000)
    rb = ReplayBuffer(storage=storage)
    col = getattr(collectors, collector)([functools.partial(_env, i) for i in range(2)], policy=None,
                                         frames_per_batch=40, total_frames=160, max_frames_per_traj=3, replay_buffer=rb)
    try:
        for _ in col:
            pass
    finally:
        col.shutdown()
    td = rb[:]
    _check_collected(td, len(rb), 2)
    steps = td["step_count"].reshape(-1)
    assert torch.equal(td["next", "step_count"].reshape(-1), steps + 1) and steps.max() == 2, steps
    print("OK", len(rb), "rows, step counts up to", td["next", "step_count"].max().item())
    del td
    storage.close()


@pytest.mark.slow
@pytest.mark.parametrize("collector, shared_init", [("MultiSyncCollector", True), ("MultiAsyncCollector", False)])
def test_collectors_whose_workers_add_keys(collector: str, shared_init: bool) -> None:
    """TorchRL's multi-process collectors with ``max_frames_per_traj=`` add a step count in their
    workers: the storage is made by the first worker's write, with those keys (it was made in the
    main process from the env's keys, the workers raised KeyError and the main process could
    hang). Run in a process group that is killed if it hangs; it must leave no segment."""
    code = f"from tests.test_torchrl import _collect; _collect({collector!r}, {shared_init})"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=280)  # pyproject's timeout is 300
    finally:
        if proc.poll() is None:  # hung: kill it and its workers
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out + err[-3000:]
    assert "OK 160 rows, step counts up to 3" in out, out + err[-3000:]
    assert not [n for n in segment.list_names() if n.startswith(f"{proc.pid}-")]


def test_no_collate_fn_needed(name: str, storages: list[ShmStorage]) -> None:
    """A ReplayBuffer on it needs no collate_fn= (TorchRL said it could not find a default)."""
    storage = ShmStorage(16, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, batch_size=4)
    rb.extend(rows(0, 10))
    batch = rb.sample()
    assert type(batch) is TensorDict and batch.batch_size == torch.Size([4])
    check(batch)


def test_plain_tensors_are_stored_and_read_back_as_tensors(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(16, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, batch_size=5)
    rb.extend(torch.arange(10.0)[:, None] * torch.ones(3))
    rb.add(torch.full((3,), 10.0))
    batch = rb.sample()
    assert type(batch) is torch.Tensor and batch.shape == (5, 3) and (batch == batch[:, :1]).all()
    assert type(rb[10]) is torch.Tensor and rb[10].tolist() == [10.0] * 3
    with pytest.raises(TypeError, match="holds tensor rows, got tensordict"):
        storage.set(11, TensorDict({"a": torch.ones(3)}, []))


@tensorclass
class Inner:
    k: torch.Tensor


@tensorclass
class Outer:
    a: torch.Tensor
    nxt: Inner


def _outer(n: int, start: int = 0) -> Any:
    seq = torch.arange(start, start + n)
    outer, inner = cast(Any, Outer), cast(Any, Inner)  # mypy does not see tensorclass's __init__
    return outer(a=seq.float(), nxt=inner(k=seq * 2, batch_size=[n]), batch_size=[n])


def test_tensorclasses_are_stored_and_read_back_as_themselves(name: str, storages: list[ShmStorage], tmp_path: Any) -> None:
    storage = ShmStorage(16, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, batch_size=4)
    rb.extend(_outer(6))
    batch = rb.sample()
    assert type(batch) is Outer and type(batch.nxt) is Inner
    assert torch.equal(batch.nxt.k, batch.a.long() * 2)
    rb[2] = _outer(1, 50)[0]
    assert rb[2].a.item() == 50 and rb[2].nxt.k.item() == 100
    storage.dumps(tmp_path / "tc")
    other = ShmStorage(16, name=name + "o")
    storages.append(other)
    other.loads(tmp_path / "tc")  # the classes are found again by name
    got = other.get(slice(None))
    assert type(got) is Outer and got.a.tolist() == [0, 1, 50, 3, 4, 5]


def test_rows_with_their_own_batch_dims(name: str, storages: list[ShmStorage]) -> None:
    """A TensorDict of batch size [k, 4] is k rows of batch size [4], as in LazyTensorStorage."""
    ours, theirs = ShmStorage(10, name=name), LazyTensorStorage(10)
    storages.append(ours)
    td = TensorDict({"x": torch.arange(12.0).reshape(3, 4)}, [3, 4])
    for s in (ours, theirs):
        s.set(range(3), td)
    assert ours.get([0, 2]).batch_size == theirs.get([0, 2]).batch_size == torch.Size([2, 4])
    assert torch.equal(ours.get([0, 2])["x"], theirs.get([0, 2])["x"])
    with pytest.raises(ValueError, match=r"rows of batch size \[4\], got \[5\]"):
        ours.set(3, TensorDict({"x": torch.zeros(5)}, [5]))


@pytest.mark.parametrize("data, error, match", [
    ({"a": torch.zeros(3, 1), "b": {"c": [torch.zeros(3)]}}, TypeError, "got dict; pytrees are not stored"),
    ([(torch.zeros(2), torch.zeros(2))] * 3, TypeError, "got a list of tuple"),
    (TensorDict({"a": torch.zeros(3), "s": "text"}, [3]), TypeError, "key 's': expected a tensor, got NonTensorData"),
    (TensorDict({"a": torch.zeros(3), "d": torch.zeros(3)}, [3]), KeyError, r"keys \['d'\] are not in this storage"),
    ([torch.zeros(2), torch.zeros(3), torch.zeros(2)], RuntimeError, "Stacking the elements of the list"),
])
def test_anything_else_is_refused_clearly_and_changes_nothing(data: Any, error: type[Exception], match: str,
                                                              name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage, collate_fn=identity)
    rb.extend(TensorDict({"a": torch.arange(3.0)}, [3]))
    with pytest.raises(error, match=match):
        rb.extend(data)
    assert len(storage) == 3 and storage.get(slice(None))["a"].tolist() == [0.0, 1.0, 2.0]


def test_copies_writers_with_colliding_cursors_lose_nothing(name: str, storages: list[ShmStorage]) -> None:
    """Writers on copies of the storage (what a process gets when the storage or its
    ReplayBuffer is pickled to it) append their runs: TorchRL's shared cursor gives writers in
    several processes the same slots, or slots past ones another has yet to write, and TorchRL's
    storages then overwrite rows just written. The original's writer keeps TorchRL's slots; an
    index write from a copy still overwrites its slot."""
    storage = ShmStorage(8, name=name)
    storages.append(storage)
    storage.set(range(8), torch.arange(8))
    storage.set(range(4, 6), torch.tensor([14, 15]))  # the original: exactly those slots
    assert storage.get(slice(None)).tolist() == [0, 1, 2, 3, 14, 15, 6, 7]
    a, b = pickle.loads(pickle.dumps(storage)), pickle.loads(pickle.dumps(storage))
    try:
        a.set(range(4, 8), torch.arange(100, 104))  # the ring's next slots are 0..3: appended there
        b.set(range(4, 8), torch.arange(200, 204))  # the same cursor again: appended after a's
        assert sorted(storage.get(slice(None)).tolist()) == [100, 101, 102, 103, 200, 201, 202, 203]
        a[5] = torch.tensor(-1)
        assert storage.get(5).item() == -1 and len(storage) == 8
    finally:
        for copy in (a, b):
            copy.buffer.close()


def steps(start: int, envs: int, t: int) -> TensorDict:
    """A ``[envs, t]`` batch as a collector gives it: element ``(e, s)`` holds ``e * 1000 + start + s``
    in every key, so an element read back names where it was written."""
    value = torch.arange(envs)[:, None] * 1000 + start + torch.arange(t)
    return TensorDict({"a": value, ("b", "c"): value.float()[..., None].expand(envs, t, 3)}, [envs, t])


@pytest.mark.parametrize("extends", [3, 9])  # without and with wrapping round
def test_ndim2_matches_lazy_tensor_storage(extends: int, name: str, storages: list[ShmStorage]) -> None:
    ours = ShmStorage(60, ndim=2, name=name)
    storages.append(ours)
    rbs = [ReplayBuffer(storage=ours), ReplayBuffer(storage=LazyTensorStorage(60, ndim=2))]
    for rb in rbs:
        for i in range(extends):
            rb.extend(steps(i * 5, 4, 5))
    mine, theirs = (rb[:] for rb in rbs)
    assert len(rbs[0]) == len(rbs[1]) and ours.shape == rbs[1].storage.shape == torch.Size([15, 4])  # [time, envs]
    assert mine.batch_size == theirs.batch_size
    assert torch.equal(mine["a"], theirs["a"]) and torch.equal(mine["b", "c"], theirs["b", "c"])
    sample = rbs[0].sample(64)
    assert sample.batch_size == torch.Size([64])
    assert torch.equal(sample["b", "c"], sample["a"].float()[:, None].expand(64, 3))
    env, step = sample["a"] // 1000, sample["a"] % 1000
    held = set(theirs["a"].reshape(-1).tolist())
    assert set(sample["a"].tolist()) <= held and (env < 4).all() and (step < 5 * extends).all()


def test_ndim2_elements_are_written_in_place(name: str, storages: list[ShmStorage]) -> None:
    storage = ShmStorage(40, ndim=2, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage)
    rb.extend(steps(0, 2, 10))
    rb[1, 3:5] = TensorDict({"a": torch.tensor([-1, -1]), ("b", "c"): -torch.ones(2, 3)}, [2])
    assert (rb[1, 3:5]["a"] == -1).all() and (rb[0, :]["a"] != -1).all()
    storage.set((2, 1), TensorDict({"a": torch.tensor(-7), ("b", "c"): -torch.ones(3)}, []))
    assert storage.get((2, 1))["a"].item() == -7 and storage.get((2, 0))["a"].item() == 2
    with pytest.raises(ValueError, match="ndim=3 is not supported"):
        ShmStorage(8, ndim=3)


def test_load_state_dict_checks_the_row_batch(name: str, storages: list[ShmStorage]) -> None:
    """A state's ``row_batch`` must be this storage's and start every field's shape: one that is
    not is refused before anything changes (the rows stay), as a foreign or tampered state."""
    storage = ShmStorage(40, ndim=2, name=name)
    storages.append(storage)
    storage.set(range(5), steps(0, 2, 5).transpose(0, 1))  # 5 rows of 2 envs
    state = storage.state_dict()
    assert state["row_batch"] == [2]
    for bad, why in (([4], "batch size"), ([2, 1], "batch size"), ("x", "list of ints")):
        with pytest.raises(ValueError, match=why):
            storage.load_state_dict({**state, "row_batch": bad})
        assert storage.row_batch == (2,) and storage.shape == torch.Size([5, 2])
    fresh = ShmStorage(40, ndim=2, name=name + "c")
    storages.append(fresh)
    with pytest.raises(ValueError, match="does not start with"):
        fresh.load_state_dict({**state, "row_batch": [3]})
    assert fresh.buffer is None
    fresh.load_state_dict(state)
    assert torch.equal(fresh.get(slice(None))["a"], storage.get(slice(None))["a"])


def _env(ident: int) -> Any:
    """A TorchRL env over ``tests.envs.EpisodeEnv`` whose observations name env ``ident``."""
    from torchrl.envs import GymWrapper

    from .envs import EpisodeEnv

    env = EpisodeEnv()
    env.env = ident
    return GymWrapper(env)


def _check_collected(td: TensorDict, total: int, envs: int) -> None:
    """Every env step is there once, whole: its next observation is the same episode a step on."""
    obs, nxt = td["observation"].reshape(-1, 4), td["next", "observation"].reshape(-1, 4)
    assert obs.shape[0] == total, "rows lost (or too many)"
    assert torch.equal(nxt[:, :2], obs[:, :2]) and torch.equal(nxt[:, 2], obs[:, 2] + 1), "a torn row"
    keys = {tuple(row) for row in obs[:, :3].long().tolist()}
    assert len(keys) == total, "a step written twice"
    assert {k[0] for k in keys} == set(range(envs))


@pytest.mark.filterwarnings("ignore:Creating .* WeightUpdaterBase is deprecated:DeprecationWarning")
@pytest.mark.parametrize("collector", ["Collector", "MultiSyncCollector", "MultiAsyncCollector"])
def test_collectors_fill_it_from_their_workers(collector: str, name: str, storages: list[ShmStorage]) -> None:
    """TorchRL's collectors given ``replay_buffer=``: the workers extend the shared storage; every
    frame arrives, once, whole (SyncDataCollector / MultiSyncDataCollector /
    MultiaSyncDataCollector are these classes' former names)."""
    import functools

    import torchrl.collectors as collectors

    storage = ShmStorage(2000, name=name)
    storages.append(storage)
    rb = ReplayBuffer(storage=storage)
    single = collector == "Collector"
    envs = functools.partial(_env, 0) if single else [functools.partial(_env, i) for i in range(2)]
    col = getattr(collectors, collector)(envs, policy=None, frames_per_batch=40, total_frames=240, replay_buffer=rb)
    try:
        for _ in col:
            pass
    finally:
        col.shutdown()
    _check_collected(rb[:], len(rb), 1 if single else 2)
    assert len(rb) >= 240


@pytest.mark.slow
def test_the_collector_example_runs() -> None:
    from .test_vector import run_example

    out = run_example("torchrl_collector.py", ["--total-frames", "400", "--frames-per-batch", "50"])
    assert "OK: 400 frames in the shared storage from 2 collector workers" in out, out
    assert "every row whole: True" in out


@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_ndim2_round_trips_keep_every_step_in_its_slot(how: str, name: str, storages: list[ShmStorage],
                                                       tmp_path: Any) -> None:
    """With ``ndim=2`` a row holds every env of a step: a copy through ``state_dict`` or ``dumps``
    of a storage that wrapped puts each step back in its slot, as TorchRL's writer and samplers
    index it (slots were found modulo ``max_size``, the elements, not the rows: steps moved)."""
    storage = ShmStorage(12, ndim=2, name=name)  # 4 steps of 3 envs
    storages.append(storage)
    rb = ReplayBuffer(storage=storage)
    for i in range(7):
        rb.extend(steps(i * 1, 3, 1))
    want = storage.get(slice(None))["a"]
    assert storage.shape == torch.Size([4, 3])
    for trip in range(3):
        copy = ShmStorage(12, ndim=2, name=f"{name}{how[0]}{trip}")
        storages.append(copy)
        if how == "state_dict":
            copy.load_state_dict(storage.state_dict())
        else:
            storage.dumps(tmp_path / f"d{trip}")
            copy.loads(tmp_path / f"d{trip}")
        assert torch.equal(copy.get(slice(None))["a"], want), trip
        storage = copy
