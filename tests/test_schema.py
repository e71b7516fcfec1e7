"""Schemas: the forms they accept, the layout they plan, and how pushed data is validated."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

import shmbuffer as sb
from shmbuffer.schema import PACK_LIMIT

from .conftest import MUJOCO, STEP, transition

Make = Callable[..., sb.ReplayBuffer]


def test_forms_agree() -> None:
    a = sb.Schema(obs=((4,), "float32"), rew=((), np.float32))
    b = sb.Schema({"obs": {"shape": (4,), "dtype": np.float32}, "rew": {"shape": (), "dtype": "f4"}})
    c = sb.Schema(rew=sb.Field("rew", (), np.dtype("float32")), obs={"shape": 4, "dtype": "float32"})
    assert a == b == c
    assert a.fingerprint == c.fingerprint  # field order does not matter
    assert a.names == ("obs", "rew") and c.names == ("rew", "obs")


def test_cpprb_env_dict_defaults() -> None:
    s = sb.Schema({"obs": {"shape": 3}, "rew": {}, "act": {"dtype": np.int32}})
    assert s["rew"].shape == (1,) and s["rew"].dtype == np.float32  # cpprb's defaults
    assert s["act"].shape == (1,) and s["act"].dtype == np.int32
    assert s["obs"].shape == (3,)


def test_json_round_trip() -> None:
    assert sb.Schema.from_json(MUJOCO.to_json()) == MUJOCO


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"_x": ((), "f4")}, "internal"),
        ({"index": ((), "f4")}, "reserved"),
        ({"x": ((0,), "f4")}, "positive"),
        ({"x": (("a",), "f4")}, "tuple of ints"),
        ({"x": ((), "U4")}, "numeric or bool"),
        ({"x": ((), object)}, "numeric or bool"),
        ({"x": ((), ">f4")}, "byte order"),
        ({"x": ((), "nonsense")}, "not a numpy dtype"),
        ({"x": (3, "f4", 1)}, r"expected \(shape, dtype\)"),
        ({"x": ((2**31, 2**31), "f4")}, r"one row of \(2147483648, 2147483648\) float32 takes .* at most 2\*\*48"),
        ({"x": ((2**64,), "u1")}, r"at most 2\*\*48"),
        ({}, "at least one"),
    ],
)
def test_bad_schemas(spec: dict, match: str) -> None:
    with pytest.raises(sb.SchemaError, match=match):
        sb.Schema(**spec)


def test_bad_env_dict() -> None:
    with pytest.raises(sb.SchemaError, match="unknown keys"):
        sb.Schema({"obs": {"shape": 3, "dtpye": "f4"}})
    with pytest.raises(sb.SchemaError, match="given twice"):
        sb.Schema({"obs": {}}, obs=((), "f4"))


def test_record_layout_is_aligned_and_packed() -> None:
    s = sb.Schema(a=((3,), "bool"), b=((), "float64"), c=((5,), "int16"), d=((2, 2), "float32"),
                  img=((64, 64), "uint8"))
    rec = s.record
    assert set(rec.offsets) == {"a", "b", "c", "d"}  # img is too large to pack
    assert [f.name for f in s.columns] == ["img"]
    assert rec.itemsize % 8 == 0
    for name, off in rec.offsets.items():
        assert off % s[name].dtype.itemsize == 0
    spans = sorted((off, off + s[n].row_bytes) for n, off in rec.offsets.items())
    assert all(e <= b for (_, e), (b, _) in itertools.pairwise(spans))  # no overlap
    assert sb.Schema(x=((PACK_LIMIT,), "uint8")).record.offsets == {"x": 0}
    assert sb.Schema(x=((PACK_LIMIT + 1,), "uint8")).record.itemsize == 0


def test_record_views_round_trip() -> None:
    rec = MUJOCO.record
    block = np.zeros((4, rec.itemsize), np.uint8)
    views = rec.views(block)
    views["obs"][:] = np.arange(17)
    views["done"][2] = True
    assert views["obs"].shape == (4, 17) and views["reward"].shape == (4,)
    assert np.shares_memory(views["obs"], block)
    assert np.array_equal(rec.views(block.copy())["obs"][3], np.arange(17))


# -- validation ---------------------------------------------------------------------------------


def test_validate_one_row_and_k_rows() -> None:
    k, arrays = MUJOCO.validate(transition(3))
    assert k == 1 and arrays["obs"].shape == (1, 17)
    k, arrays = MUJOCO.validate(transition(3, 5))
    assert k == 5 and arrays["done"].shape == (5,)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.pop("reward"), r"missing field 'reward' \(\(\) float32\)"),
        (lambda d: d.update(rew=1.0), r"unknown field 'rew' \(did you mean 'reward'\?\)"),
        (lambda d: d.update(obs=np.zeros(16, np.float32)), r"field 'obs': expected shape \(17,\) .* got \(16,\) float32"),
        (lambda d: d.update(obs=np.zeros((2, 3, 17), np.float32)), r"field 'obs': expected shape"),
        (lambda d: d.update(action=np.zeros((2, 6), np.float32)), r"ragged batch: field 'obs' has one row, field 'action' has 2 rows"),
        (lambda d: d.update(done=np.float32(0.5)), r"field 'done': expected bool, got float32: a float flag is refused"),
        (lambda d: d.update(done=1.0), r"field 'done': expected bool, got float64: a float flag is refused"),
        (lambda d: d.update(reward="x"), r"field 'reward': expected float32, got <U1"),
        (lambda d: d.update(reward=1j), r"field 'reward': expected float32, got complex128"),
    ],
)
def test_validate_errors(change: object, match: str) -> None:
    data = transition(1)
    change(data)  # type: ignore[operator]
    with pytest.raises(sb.FieldError, match=match):
        MUJOCO.validate(data)


def test_ragged_rows() -> None:
    data = transition(0, 4)
    data["reward"] = data["reward"][:3]
    with pytest.raises(sb.FieldError, match="ragged batch: field 'obs' has 4 rows, field 'reward' has 3 rows"):
        MUJOCO.validate(data)


def test_casting_rules() -> None:
    s = sb.Schema(f=((), "float32"), i=((), "int8"), b=((), "bool"))
    ok = [
        {"f": np.float64(1.5), "i": 3, "b": True},            # float64 -> float32, python int -> int8
        {"f": 2, "i": np.int64(-128), "b": 1},                # int -> float, ints that fit, int 1 -> bool
        {"f": np.float16(1), "i": np.uint8(127), "b": np.bool_(False)},
    ]
    for data in ok:
        assert s.validate(data)[0] == 1
    for data, match in [
        ({"f": 1.0, "i": 300, "b": True}, r"field 'i': expected int8 values in \[-128, 127\], got int64 values in \[300, 300\]"),
        ({"f": 1.0, "i": 1.0, "b": True}, r"field 'i': expected int8, got float64, which does not cast safely"),
        ({"f": 1.0, "i": 1, "b": 2}, r"field 'b': expected bool, got int64 with values other than 0 and 1"),
        ({"f": 1.0, "i": 1, "b": 0.0}, r"field 'b': expected bool, got float64: a float flag is refused"),
    ]:
        with pytest.raises(sb.FieldError, match=match):
            s.validate(data)


def test_zero_rows_validate() -> None:
    data = {k: v[:0] for k, v in transition(0, 2).items()}
    assert MUJOCO.validate(data)[0] == 0


def test_float_values_that_would_overflow_are_refused() -> None:
    s = sb.Schema(x=((2,), "float32"))
    with pytest.raises(sb.FieldError, match=r"field 'x': expected float32 values within \+-3\.4e\+38, got float64 values up to 1e\+300"):
        s.validate({"x": np.array([1.0, 1e300])})
    assert s.validate({"x": np.array([np.inf, np.nan])})[0] == 1  # inf and nan stay what they are
    with pytest.raises(sb.FieldError, match="up to 1e\\+39"):  # a NaN beside it hides nothing
        s.validate({"x": np.array([np.nan, 1e39])})
    with pytest.raises(sb.FieldError, match=r"expected float16 values within .* got int64 values up to 7e\+04"):
        sb.Schema(h=((), "float16")).validate({"h": 70_000})
    with pytest.raises(sb.FieldError, match="complex64"):
        sb.Schema(c=((), "complex64")).validate({"c": np.complex128(1e300)})


def test_cpprb_shape_one_takes_scalars() -> None:
    s = sb.Schema({"rew": {}, "obs": {"shape": 3}})  # cpprb: rew has shape (1,)
    assert s.validate({"rew": 1.0, "obs": np.zeros(3)})[1]["rew"].shape == (1, 1)
    assert s.validate({"rew": np.ones(5), "obs": np.zeros((5, 3))})[1]["rew"].shape == (5, 1)
    assert s.validate({"rew": np.ones((5, 1)), "obs": np.zeros((5, 3))})[0] == 5


def test_push_options_are_reserved_names() -> None:
    for name in ("timeout", "episode", "priority", "lane"):
        with pytest.raises(sb.SchemaError, match="reserved"):
            sb.Schema(**{name: ((), "f4")})


def test_reset_tuple_names_the_field(make: Make, name: str) -> None:
    buf = make(STEP, capacity=8, name=name)
    reset = (np.zeros(3, np.float32), {})
    with pytest.raises(sb.FieldError, match=r"field 'obs': .*\(obs, info\).*obs, info = env.reset\(\)"):
        buf.push(obs=reset, action=0, reward=0.0, next_obs=np.zeros(3), done=False)
    with pytest.raises(sb.FieldError, match=r"field 'obs': cannot be made an array"):
        buf.push(obs=[np.zeros(3), np.zeros(2)], action=0, reward=0.0, next_obs=np.zeros(3), done=False)
    assert len(buf) == 0


def test_tensor_that_requires_grad_names_the_field(make: Make, name: str) -> None:
    buf = make(STEP, capacity=8, name=name)
    q = torch.zeros(3, requires_grad=True) * 2
    with pytest.raises(sb.FieldError, match=r"field 'next_obs': got a tensor that requires grad; push value.detach\(\)"):
        buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=q, done=False)
    buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=q.detach(), done=False)
    assert len(buf) == 1


def test_float_done_into_bool_is_refused(make: Make, name: str) -> None:
    buf = make(STEP, capacity=8, name=name)
    with pytest.raises(sb.FieldError, match=r"field 'done': expected bool, got float64: a float flag is refused"):
        buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=np.zeros(3), done=1.0)
    buf.push(obs=np.zeros(3), action=0, reward=0.0, next_obs=np.zeros(3), done=1)  # ints 0/1 are fine
    assert len(buf) == 1
