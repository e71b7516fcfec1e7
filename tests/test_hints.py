"""Errors that point the way: other libraries' names end in an error naming ours (``hints.py``),
and the errors of a first hour say what to do."""

from __future__ import annotations

import importlib
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import shmbuffer as sb
from shmbuffer import demo, hints
from shmbuffer.errors import UnknownName
from shmbuffer.shm import segment

from .conftest import MUJOCO, transition

Make = Callable[..., sb.ReplayBuffer]
ROOT = Path(__file__).resolve().parent.parent
NAMES = "\n".join(p.read_text() for p in sorted((ROOT / "docs" / "migration").glob("*.md")))
CODE = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", NAMES, flags=re.S))  # inline code, outside blocks


@pytest.mark.parametrize("table", ["METHODS", "KEYWORDS", "KEYS"])
def test_every_hint_is_a_name_docs_names_md_gives(table: str) -> None:
    """The table is docs/migration/'s, not a second opinion: each name it knows is written there in code,
    and each library it names has a page there."""
    missing = [n for n in getattr(hints, table) if not any(re.search(rf"\b{re.escape(n)}\b", c) for c in CODE)]
    assert not missing, f"hints.{table} names absent from docs/migration/: {missing}"
    pages = {hints.page(whose) for whose, _ in getattr(hints, table).values()}
    assert all((ROOT / p).is_file() for p in pages), pages


def test_no_hint_hides_a_real_attribute() -> None:
    real = [n for n in hints.METHODS if hasattr(sb.ReplayBuffer, n)]
    assert not real, f"hints for attributes ReplayBuffer has: {real}"


@pytest.mark.parametrize(("attr", "ours"), [
    ("get_stored_size", "len(buf) or buf.size"),
    ("get_buffer_size", "buf.capacity"),
    ("extend", "push(...) with a leading dimension"),
    ("update_priority", "update_priorities("),
    ("destroy", "unlink()"),
])
def test_another_librarys_method_names_ours(make: Make, name: str, attr: str, ours: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(sb.UnknownName) as info:
        getattr(buf, attr)
    assert isinstance(info.value, AttributeError) and info.value.name == attr
    message = str(info.value)
    assert ours in message and "docs/migration/" in message and f"'{attr}'" in message
    assert not hasattr(buf, attr)


def test_the_hints_are_descriptors_not_a_getattr(make: Make, name: str) -> None:
    """Each hinted name is a descriptor on the class, so reading the buffer's own names never
    passes through a ``__getattr__`` (CPython specialises those reads); the class says the same,
    and ``dir`` lists none of them."""
    assert "__getattr__" not in vars(sb.ReplayBuffer) and "__getattribute__" not in vars(sb.ReplayBuffer)
    with pytest.raises(sb.UnknownName, match=r"ReplayBuffer has no 'get_stored_size' \(cpprb's name\)"):
        sb.ReplayBuffer.get_stored_size  # noqa: B018
    buf = make(MUJOCO, capacity=10, name=name)
    assert not set(hints.METHODS) & set(dir(buf)) and {"push", "sample", "capacity"} <= set(dir(buf))


def test_an_unknown_attribute_stays_a_plain_attribute_error(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(AttributeError, match="has no attribute 'frobnicate'") as info:
        buf.frobnicate  # noqa: B018
    assert type(info.value) is AttributeError
    again = pickle.loads(pickle.dumps(buf))  # pickling probes for attributes: still works
    try:
        assert again.name == name and len(again) == 0
    finally:
        again.close()


@pytest.mark.parametrize(("kw", "pointer"), [
    ({"beta": 0.5}, "Prioritized(beta=...)"),
    ({"env": None}, "shmbuffer.sb3.ReplayBuffer"),
    ({"batch_size": 32}, "sample(n)"),
    ({"return_info": True}, "batch.weight"),
])
def test_another_librarys_sample_keyword_names_ours(make: Make, name: str, kw: dict[str, object], pointer: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))
    with pytest.raises(sb.UnknownKeyword) as info:
        buf.sample(32, **kw)
    assert isinstance(info.value, TypeError)
    message = str(info.value)
    assert message.startswith(f"sample() takes no {next(iter(kw))!r}") and pointer in message
    assert "docs/migration/" in message
    assert buf.stats["sampled"] == 0  # refused before anything was drawn


def test_an_unknown_sample_keyword_is_a_type_error(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    buf.push(transition(0, 4))
    with pytest.raises(TypeError, match=r"sample\(\) got an unexpected keyword argument 'bogus'; see help\(sample\)"):
        buf.sample(2, bogus=1)


def test_another_librarys_constructor_keyword_names_ours(name: str) -> None:
    with pytest.raises(sb.UnknownKeyword, match=r"ReplayBuffer\(\) takes no 'device' .*Loader\(buf, batch_size, device"):
        sb.ReplayBuffer(MUJOCO, 10, name=name, device="cpu")
    with pytest.raises(sb.UnknownKeyword, match=r"takes no 'Nstep' .*n_step=3"):
        sb.ReplayBuffer(MUJOCO, 10, name=name, Nstep={"size": 3})
    assert not os.path.exists(segment.path_of(name))  # refused before the block was made


BOX = {"obs": {"shape": 4}}


def _torchrl_storage(size: int) -> object:
    from torchrl.data import LazyTensorStorage

    return LazyTensorStorage(size)


@pytest.mark.parametrize(("call", "error", "says"), [
    (lambda: sb.ReplayBuffer(1000, env_dict=BOX), sb.UnknownKeyword,
     r"takes no 'env_dict' \(cpprb's ReplayBuffer\(size, env_dict\)\); here: ReplayBuffer\(env_dict, capacity\).*cpprb\.md"),
    (lambda: sb.ReplayBuffer(1000, BOX), sb.ForeignCall,
     r"is cpprb's ReplayBuffer\(size, env_dict\); here: ReplayBuffer\(env_dict, 1000\).*"
     r"shmbuffer\.compat\.cpprb\.ReplayBuffer\(1000, env_dict\).*cpprb\.md"),
    (lambda: sb.ReplayBuffer(size=1000, env_dict=BOX), sb.UnknownKeyword, r"takes no 'size' .*cpprb\.md"),
    (lambda: sb.ReplayBuffer(1000, "obs_space", "act_space"), sb.ForeignCall,
     r"Stable-Baselines3's ReplayBuffer\(buffer_size, observation_space, action_space\); here: "
     r"ReplayBuffer\(schema, 1000, envs=n_envs\).*shmbuffer\.sb3\.ReplayBuffer.*sb3\.md"),
    (lambda: sb.ReplayBuffer(buffer_size=1000, observation_space="o", action_space="a"), sb.UnknownKeyword,
     r"takes no 'buffer_size' .*shmbuffer\.sb3\.ReplayBuffer.*sb3\.md"),
    (lambda: sb.ReplayBuffer(observation_space="o", action_space="a"), sb.UnknownKeyword,
     r"takes no 'observation_space' .*sb3\.md"),
    (lambda: sb.ReplayBuffer(storage=None, batch_size=8), sb.UnknownKeyword,
     r"takes no 'storage' \(TorchRL's ReplayBuffer\(storage=...\)\).*ShmStorage.*torchrl\.md"),
    (lambda: sb.ReplayBuffer(_torchrl_storage(1000)), sb.ForeignCall,
     r"ReplayBuffer\(LazyTensorStorage\(...\)\) is TorchRL's ReplayBuffer\(storage=...\).*ShmStorage.*torchrl\.md"),
    (lambda: sb.ReplayBuffer(max_size=1000), sb.UnknownKeyword, r"takes no 'max_size' .*ShmStorage.*torchrl\.md"),
    (lambda: sb.ReplayBuffer(1000), sb.ForeignCall,
     r"the capacity came first; here the schema comes first, ReplayBuffer\(schema, 1000\).*migration/index\.md"),
], ids=["cpprb-env_dict=", "cpprb-positional", "cpprb-keywords", "sb3-positional", "sb3-buffer_size=",
        "sb3-spaces=", "torchrl-storage=", "torchrl-storage-positional", "torchrl-max_size=", "capacity-first"])
def test_another_librarys_constructor_form_names_ours(call: Callable[[], object], error: type[Exception],
                                                      says: str) -> None:
    """cpprb's, SB3's and TorchRL's constructors, positional or keyword, end in our error naming our
    call and the migration page, not in Python's "missing 1 required positional argument"."""
    def mine() -> set[str]:  # blocks named as this process names them: other processes make theirs meanwhile
        return {n for n in segment.list_names() if n.startswith(f"{os.getpid()}-")}

    before = mine()
    with pytest.raises(error, match=says) as info:
        call()
    assert isinstance(info.value, TypeError)
    assert mine() == before  # refused before a block was made


def test_no_constructor_hint_hides_a_real_keyword() -> None:
    import inspect
    real = set(inspect.signature(sb.ReplayBuffer.__init__).parameters)
    assert not real & set(hints.KEYWORDS), real & set(hints.KEYWORDS)


def test_our_own_constructor_forms_are_untouched(make: Make, name: str) -> None:
    assert len(make(BOX, 10, name=name)) == 0
    assert make(schema=MUJOCO, capacity=10, name=f"{name}-kw").capacity == 10


def test_another_librarys_batch_key_names_ours(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name, sampler=sb.Prioritized())
    buf.push(transition(0, 4))
    batch = buf.sample(3)
    with pytest.raises(sb.UnknownKey) as info:
        batch["weights"]
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert not message.startswith("'")  # KeyError would quote the whole sentence
    assert "batch has no field 'weights'" in message and "here: batch.weight" in message and "cpprb" in message
    with pytest.raises(sb.UnknownName, match=r"'observations' is Stable-Baselines3's name, here: the names of your"):
        batch.observations  # noqa: B018
    with pytest.raises(KeyError, match=r"batch has no field 'nope': fields obs, .*extras index, weight$"):
        batch["nope"]
    with pytest.raises(AttributeError) as plain:
        batch.nope  # noqa: B018
    assert type(plain.value) is AttributeError


# -- the messages of a first hour ------------------------------------------------------------------
def test_closed_error_says_attach_again(name: str) -> None:
    buf = sb.ReplayBuffer(MUJOCO, 10, name=name)
    buf.close()
    try:
        with pytest.raises(sb.ClosedError, match=rf"closed in this process; attach it again with "
                                                 rf"ReplayBuffer.attach\('{name}'\)"):
            buf.sample(1)
    finally:
        buf.unlink()


def test_segment_not_found_points_to_shmbuffer_ls(name: str) -> None:
    with pytest.raises(sb.SegmentNotFound, match=r"no buffer named .*; yours here: .*`shmbuffer ls` lists them"):
        sb.ReplayBuffer.attach(name)


def test_too_few_rows_for_distinct_rows_says_what_to_do(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    buf.push(transition(0))
    with pytest.raises(sb.EmptyBufferError, match=r"holds only 1 row; sample at most 1 distinct rows, .*replace=True"):
        buf.sample(2, replace=False)


def test_wrong_shape_names_both_shapes_plainly(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    row = transition(0)
    with pytest.raises(sb.FieldError, match=r"field 'obs': expected shape \(17,\) \(one row\) or \(k, 17\) \(k rows\)"):
        buf.push({**row, "obs": np.zeros(4, np.float32)})
    with pytest.raises(sb.FieldError, match=r"field 'reward': expected shape \(\) \(one row\) or \(k,\) \(k rows\)"):
        buf.push({**row, "reward": np.zeros((2, 2), np.float32)})


def test_epoch_of_an_empty_buffer_says_so(make: Make, name: str) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    with pytest.raises(sb.EmptyBufferError, match=r"epoch\(32\): buffer .* is empty; push rows first"):
        next(buf.epoch(32))


def test_demo_line_shows_no_nan_before_the_first_evaluation(make: Make, name: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    buf = make(MUJOCO, capacity=10, name=name)
    demo._line(1.0, {"env_steps": 10, "recent_return": float("nan")}, buf, 0, [])
    demo._line(2.0, {"env_steps": 20, "recent_return": 12.5}, buf, 5, [30.0])
    first, second = capsys.readouterr().out.splitlines()
    assert "nan" not in first and first.endswith("return      -  eval      -")
    assert second.endswith("return   12.5  eval   30.0")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_ls_and_not_found_keep_to_your_buffers(make: Make, name: str) -> None:
    theirs = f"{name}-theirs"
    path = segment.path_of(theirs)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    try:
        os.chown(path, 54321, 54321)
        make(MUJOCO, capacity=10, name=name)
        env = {**os.environ, "PYTHONWARNINGS": "error", "PYTHONPATH": str(ROOT)}

        def ls(*args: str) -> str:
            out = subprocess.run([sys.executable, "-m", "shmbuffer.cli", "ls", *args], capture_output=True,
                                 text=True, timeout=60, env=env, cwd=ROOT)
            assert out.returncode == 0, out.stderr
            return out.stdout

        assert name in ls() and theirs not in ls()
        assert name in ls("--all") and theirs in ls("--all")
        with pytest.raises(sb.SegmentNotFound) as info:
            sb.ReplayBuffer.attach(f"{name}-missing")
        assert name in str(info.value) and theirs not in str(info.value)
    finally:
        os.unlink(path)


def test_ls_lists_only_your_buffers_unless_all(make: Make, name: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Seen by another user (a faked uid: runs without root), this process's buffer is theirs."""
    import json

    from shmbuffer import cli

    make(MUJOCO, capacity=10, name=name)
    assert cli.main(["ls", "--json"]) == 0
    assert name in [e["name"] for e in json.loads(capsys.readouterr().out)]
    monkeypatch.setattr(segment.os, "geteuid", lambda: os.getuid() + 4242)
    assert cli.main(["ls", "--json"]) == 0
    assert name not in [e["name"] for e in json.loads(capsys.readouterr().out)]
    assert cli.main(["ls", "--all", "--json"]) == 0
    theirs = next(e for e in json.loads(capsys.readouterr().out) if e["name"] == name)
    assert "not to this process's user" in theirs["error"]  # listed, never read


def test_cpprb_argument_order_says_schema_first(name: str) -> None:
    with pytest.raises(sb.ForeignCall, match=r"cpprb's ReplayBuffer\(size, env_dict\); here: ReplayBuffer\(env_dict, 32\)"):
        sb.ReplayBuffer(32, {"obs": {"shape": 3}}, name=name)  # type: ignore[arg-type]


@pytest.mark.parametrize("alias, facade", [
    ("add", "shmbuffer.compat.cpprb.ReplayBuffer"),
    ("get_all_transitions", "shmbuffer.compat.cpprb.ReplayBuffer"),
    ("export_data", "shmbuffer.compat.ding.DequeBuffer"),
    ("reset", "shmbuffer.compat.mindspore.ReplayBuffer"),
])
def test_an_alias_on_the_plain_buffer_names_the_facade_that_has_it(alias: str, facade: str) -> None:
    """Other libraries' aliases live in their facades: the plain buffer's error names the facade,
    and the facade has the name."""
    with pytest.raises(UnknownName, match=re.escape(facade)):
        getattr(sb.ReplayBuffer, alias)
    module, cls = facade.rsplit(".", 1)
    assert callable(getattr(getattr(importlib.import_module(module), cls), alias))
