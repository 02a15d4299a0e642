"""The input pipeline: loading, tokens, the resumable process-aware batch stream, global arrays."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshkit.data import Batches, DataError, global_batch
from meshkit.data.text import decode, encode, load_text, split


@pytest.fixture(scope="module")
def default():
    return load_text()


def _take(batches, n):
    return [next(batches) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        np.array_equal(x, y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True)
    )


def test_default_text_loads_and_round_trips(default):
    assert len(default.tokens) > 400_000 and default.tokens.dtype == np.int32
    assert default.vocab == tuple(sorted(default.vocab)) and default.vocab_size == len(default.vocab)
    assert "pydoc_data" in default.source
    text = decode(default.tokens, default.vocab)
    assert len(text) == len(default.tokens) and np.array_equal(encode(text, default.vocab), default.tokens)


def test_text_file_and_unknown_character(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld\n", encoding="utf-8")
    data = load_text(str(path))
    assert data.vocab == tuple(sorted(set("héllo wörld\n"))) and data.source == str(path)
    assert decode(data.tokens, data.vocab) == "héllo wörld\n"
    with pytest.raises(DataError, match="'z' is not in the vocabulary"):
        encode("hz", data.vocab)


def test_npy_token_ids(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.array([3, 0, 7, 7], dtype=np.int64))
    data = load_text(str(path))
    assert data.vocab is None and data.vocab_size == 8 and data.tokens.dtype == np.int32
    assert data.tokens.tolist() == [3, 0, 7, 7] and decode(data.tokens, None) == "3 0 7 7"


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("missing.txt", None, "no data file .*: give a UTF-8 text file or a .npy of token ids"),
        ("empty.txt", b"", "is empty"),
        ("latin1.txt", "café".encode("latin-1"), "not UTF-8 text .* save it as UTF-8"),
        ("2d.npy", np.zeros((2, 3), np.int32), "1-D array of integer token ids"),
        ("float.npy", np.zeros(4, np.float32), "1-D array of integer token ids"),
        ("empty.npy", np.zeros(0, np.int32), "non-empty 1-D array"),
        ("negative.npy", np.array([1, -2], np.int32), "non-negative"),
        ("junk.npy", b"not an array", "cannot read .* as a .npy"),
    ],
)
def test_bad_inputs_give_one_line_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=match) as info:
        load_text(str(path))
    assert "\n" not in str(info.value)


def test_split_sizes():
    tokens = np.arange(1000, dtype=np.int32)
    train, held = split(tokens, 0.1)
    assert len(train) == 900 and len(held) == 100 and held[0] == 900
    assert len(split(tokens, 0.0)[1]) == 0
    with pytest.raises(DataError, match="eval fraction"):
        split(tokens, 1.0)


def test_batches_are_deterministic_windows():
    tokens = np.arange(500, dtype=np.int32)
    a = _take(Batches(tokens, seq_len=16, global_batch=8, seed=1), 3)
    assert _same(a, _take(Batches(tokens, seq_len=16, global_batch=8, seed=1), 3))
    assert not _same(a, _take(Batches(tokens, seq_len=16, global_batch=8, seed=2), 3))
    inputs, targets = a[0]
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == targets.dtype == np.int32
    # Consecutive ids: every row is a window, and the targets are the inputs shifted by one.
    assert np.array_equal(targets, inputs + 1)
    assert np.array_equal(inputs, inputs[:, :1] + np.arange(16))


def test_batches_cover_every_start_each_epoch():
    tokens = np.arange(20, dtype=np.int32)  # 4 starts for seq_len 16
    starts = [
        row[0]
        for inputs, _ in _take(Batches(tokens, seq_len=16, global_batch=2, seed=0), 4)
        for row in inputs
    ]
    assert sorted(starts[:4]) == sorted(starts[4:]) == [0, 1, 2, 3]


def test_resume_through_json_state():
    tokens = np.arange(300, dtype=np.int32)
    straight = _take(Batches(tokens, seq_len=8, global_batch=4, seed=3), 6)
    first = Batches(tokens, seq_len=8, global_batch=4, seed=3)
    head = _take(first, 3)
    resumed = Batches(tokens, seq_len=8, global_batch=4, seed=3)
    resumed.restore(json.loads(json.dumps(first.state)))
    assert _same(straight, head + _take(resumed, 3))
    other = Batches(tokens, seq_len=8, global_batch=4, seed=4)
    with pytest.raises(DataError, match="seed=3 but this run has seed=4"):
        other.restore(first.state)


def test_processes_read_their_slice_of_the_global_batch():
    tokens = np.arange(400, dtype=np.int32)
    whole = _take(Batches(tokens, seq_len=8, global_batch=6, seed=5, process_index=0, process_count=1), 3)
    parts = [
        _take(Batches(tokens, seq_len=8, global_batch=6, seed=5, process_index=p, process_count=2), 3)
        for p in range(2)
    ]
    for b, (inputs, targets) in enumerate(whole):
        assert parts[0][b][0].shape == (3, 8)
        assert np.array_equal(inputs, np.concatenate([parts[0][b][0], parts[1][b][0]]))
        assert np.array_equal(targets, np.concatenate([parts[0][b][1], parts[1][b][1]]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"seq_len": 512, "global_batch": 4},
            "sequence length 512 needs at least 513 tokens but the data has 100",
        ),
        (
            {"seq_len": 8, "global_batch": 5, "process_index": 0, "process_count": 2},
            "use a --batch-size that is a multiple of 2",
        ),
        ({"seq_len": 8, "global_batch": 4, "seed": -1}, "seed"),
        ({"seq_len": 0, "global_batch": 4}, "must be positive"),
    ],
)
def test_batches_errors(kwargs, match):
    with pytest.raises(DataError, match=match):
        Batches(np.arange(100, dtype=np.int32), **kwargs)


def test_global_batch_on_eight_devices():
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    local = next(Batches(np.arange(200, dtype=np.int32), seq_len=4, global_batch=16, seed=0))
    arrays = global_batch(sharding, local)
    for array, host in zip(arrays, local, strict=True):
        assert array.sharding == sharding and array.shape == (16, 4)
        assert np.array_equal(np.asarray(array), host)
