"""What a prepared directory and a datasets directory may name, and what a run trusts of them: shards
verified against their manifest at open (sha256, ids within the vocabulary) with a stamp that spares a
second hash and never outlives a change; names that leave their directory refused; and one
``meshkit data prepare`` per ``--out`` (a lock, stale hidden directories of dead prepares removed,
SIGTERM and a failed write leaving nothing)."""

import errno
import json
import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from meshkit.cli import main
from meshkit.data import DataError, load, readers
from meshkit.data import prepare as P
from meshkit.data import shards as S
from meshkit.data.text import default_documents

VOCAB = 300


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Stamps in this test's own cache."""
    monkeypatch.setenv("MESHKIT_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def scans(monkeypatch):
    """The shards hashed, in order (each call of ``shards.scan``)."""
    seen = []
    real = S.scan

    def counted(path, dtype, below):
        seen.append(path.name)
        return real(path, dtype, below)

    monkeypatch.setattr(S, "scan", counted)
    return seen


def _text(root):
    (root / "text").mkdir(parents=True)
    for i, t in enumerate(default_documents()[:4]):
        (root / "text" / f"{i}.txt").write_text(t[:3000], encoding="utf-8")
    return root / "text"


def _prepared(root, name="data"):
    P.prepare([str(_text(root))], root / name, vocab_size=VOCAB, shard_tokens=1500)
    return root / name


def _one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    return err


def test_shards_are_verified_once_and_a_changed_shard_is_refused(tmp_path, scans, monkeypatch):
    data = _prepared(tmp_path)
    shard_names = [s["file"] for s in json.loads((data / S.MANIFEST).read_text())["shards"]]
    assert len(shard_names) > 2
    S.open_shards(data)
    assert scans == []  # prepare stamped what it wrote
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)  # new files: nothing of the stamp holds for them
    S.open_shards(copy)
    assert sorted(scans) == shard_names
    S.open_shards(copy)
    load(str(copy))
    assert sorted(scans) == shard_names  # a second open (and a run's) reads the stamp only

    # an id out of the vocabulary written in place, same size, its mtime set back: the ctime still moved
    shard = copy / shard_names[1]
    before = shard.stat()
    raw = bytearray(shard.read_bytes())
    raw[20:22] = np.array([65535], "<u2").tobytes()
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(
        DataError, match=re.escape(f"token shard '{shard}' is not the one its manifest names")
    ):
        load(str(copy))
    # a manifest made to agree with that shard: the id itself is refused
    manifest = json.loads((copy / S.MANIFEST).read_text())
    manifest["shards"][1]["sha256"] = S.hashlib.sha256(bytes(raw)).hexdigest()
    (copy / S.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"holds 65535 at position 10, but the vocabulary has {VOCAB} ids"):
        S.open_shards(copy)

    # --chat's masks: 0 or 1 per id
    mask = bytes([0, 1, 1, 7, 1])
    (data / "mask-00000.bin").write_bytes(mask)
    manifest = json.loads((data / S.MANIFEST).read_text())
    sha = S.hashlib.sha256(mask).hexdigest()
    manifest["chat"] = {"masks": [{"file": "mask-00000.bin", "tokens": 5, "bytes": 5, "sha256": sha}]}
    (data / S.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"mask shard .* holds 7 at position 3, but a mask holds 0 or 1"):
        S.open_shards(data)
    del manifest["chat"]
    (data / S.MANIFEST).write_text(json.dumps(manifest))

    monkeypatch.setenv("MESHKIT_DATA_CACHE", "off")  # no stamps: every open hashes
    scans.clear()
    S.open_shards(data)
    S.open_shards(data)
    assert sorted(scans) == sorted(shard_names * 2)


def test_document_offsets_that_do_not_fit_the_stream_are_refused(tmp_path):
    data = _prepared(tmp_path)
    tokens = json.loads((data / S.MANIFEST).read_text())["tokens"]
    assert S.documents(data, tokens)[-1] == tokens
    for ends in ([5, 3, tokens], [0, tokens], [3, tokens - 1], []):
        np.save(data / S.DOCUMENTS, np.array(ends, np.int64))
        with pytest.raises(
            DataError, match=f"does not hold the documents' increasing end offsets, the last {tokens}"
        ):
            S.documents(data, tokens)


def test_a_run_never_trains_on_a_tampered_shard(tmp_path, capsys):
    data = _prepared(tmp_path)
    shard = data / "shard-00000.bin"
    shard.write_bytes(b"\xff\xff" + shard.read_bytes()[2:])
    run = ["train", "--preset", "tiny", "--data", str(data), "--run-dir", str(tmp_path / "run")]
    _one_line_exit_2(capsys, run, "shard-00000.bin' is not the one its manifest names")
    assert not (tmp_path / "run").exists()


def test_names_that_leave_their_directory_are_refused(tmp_path):
    data, other = _prepared(tmp_path), tmp_path / "code"
    shutil.copytree(data, other)
    shutil.move(other / "shard-00000.bin", tmp_path / "loose.bin")
    manifest = json.loads((data / S.MANIFEST).read_text())
    for name in ("../code/shard-00001.bin", str(other / "shard-00001.bin"), "."):
        manifest["shards"][0]["file"] = name
        (data / S.MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(DataError, match="which leads outside"):
            S.open_shards(data)
    manifest["shards"][0]["file"] = "shard-00000.bin"
    manifest["chat"] = {
        "masks": [{**manifest["shards"][1], "file": "../code/shard-00001.bin"}]
    }  # --chat's masks
    (data / S.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=re.escape("names '../code/shard-00001.bin', which leads outside")):
        S.open_shards(data)
    del manifest["chat"]
    manifest["shards"][0]["file"] = "link.bin"  # a link inside, to a file outside
    (data / S.MANIFEST).write_text(json.dumps(manifest))
    (data / "link.bin").symlink_to(tmp_path / "loose.bin")
    with pytest.raises(
        DataError, match=re.escape(f"names 'link.bin', which leads outside '{data}' (to '{tmp_path}/loose")
    ):
        S.open_shards(data)

    # a datasets directory: state.json and dataset_dict.json name files and splits inside it only
    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True)
    table = pa.table({"text": ["a row of text"]})
    with pa.OSFile(str(tmp_path / "outside.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (ds / readers.DATASET_DICT).write_text(json.dumps({"splits": ["train", "../ds2"]}))
    (ds / "train" / readers.DATASET_INFO).write_text("{}")
    state = ds / "train" / readers.DATASET_STATE
    for name in ("../../outside.arrow", str(tmp_path / "outside.arrow")):
        state.write_text(json.dumps({"_data_files": [{"filename": name}]}))
        with pytest.raises(DataError, match=re.escape(f"'{state}' names '{name}', which leads outside")):
            readers.list_inputs([str(ds)])
    with pytest.raises(DataError, match=re.escape("names '../ds2', which leads outside")):
        readers.list_inputs([str(ds)], split="../ds2")


@pytest.mark.parametrize(
    ("dict_json", "state_json", "says"),
    [
        (None, [], "state.json' holds a JSON array, not an object with '_data_files'"),
        (None, {"_data_files": {"filename": "a.arrow"}}, "'_data_files' is not a list"),
        (None, {"_data_files": [{"filename": 3}]}, "names the file 3, which is not a file name"),
        (None, {"_data_files": [], "_split": 1}, "'_split' is a JSON number, not a split's name"),
        ({"splits": "train_and_test"}, {}, "'splits' is not a list of names"),
        ([1], {}, "dataset_dict.json' holds a JSON array, not an object with 'splits'"),
        (None, "[" * 100_000 + "]" * 100_000, "state.json': it is nested too deeply"),
    ],
)
def test_datasets_json_of_the_wrong_shape_is_one_line(tmp_path, capsys, dict_json, state_json, says):
    ds = tmp_path / "ds"
    where = ds / "train" if dict_json is not None else ds
    where.mkdir(parents=True)
    if dict_json is not None:
        (ds / readers.DATASET_DICT).write_text(json.dumps(dict_json))
    (where / readers.DATASET_INFO).write_text("{}")
    raw = state_json if isinstance(state_json, str) else json.dumps(state_json)
    (where / readers.DATASET_STATE).write_text(raw)
    _one_line_exit_2(capsys, ["data", "prepare", str(ds), "--out", str(tmp_path / "out")], says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_one_prepare_per_out_and_stale_hidden_directories_are_removed(tmp_path):
    text, out = _text(tmp_path), tmp_path / "out"
    left = [tmp_path / ".out.partial-4194999", tmp_path / ".out.partial-1"]  # prepares killed with SIGKILL
    for d in left:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "shard-00000.bin").write_bytes(b"\0" * 64)
    (tmp_path / ".other.partial-7").mkdir()  # another --out's: not this prepare's to remove
    with P.output_lock(out):  # a prepare into out in progress
        (tmp_path / f".out.partial-{os.getpid()}").mkdir()
        with pytest.raises(
            DataError,
            match=re.escape(
                f"--out '{out}' is being prepared by another meshkit data prepare (pid {os.getpid()}"
            ),
        ):
            P.prepare([str(text)], out, vocab_size=VOCAB)
        assert (
            tmp_path / f".out.partial-{os.getpid()}"
        ).is_dir() and not out.exists()  # the loser wrote nothing
        (tmp_path / f".out.partial-{os.getpid()}").rmdir()
    P.prepare([str(text)], out, vocab_size=VOCAB)
    assert S.is_prepared(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-7", "cache", "out", "text"]


def test_sigterm_during_prepare_leaves_nothing(tmp_path, capsys, monkeypatch):
    text, out = _text(tmp_path), tmp_path / "out"
    real = S.ShardWriter.add

    def add(self, pieces, *, end):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the shards are being written
        return real(self, pieces, end=end)

    monkeypatch.setattr(S.ShardWriter, "add", add)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["data", "prepare", str(text), "--out", str(out), "--vocab-size", str(VOCAB)]) == 143
    assert capsys.readouterr().err == f"error: stopped by SIGTERM: --out {out} was not written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]  # no partial directory, no lock
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("failure", ["read-only", "full"])
def test_a_prepare_that_cannot_write_is_one_line_naming_the_directory_and_free_space(
    tmp_path, capsys, monkeypatch, failure
):
    text, out = _text(tmp_path), tmp_path / "out"
    if (
        failure == "read-only"
    ):  # every way prepare creates something beside --out fails as on a read-only mount
        real_open, real_mkdir = os.open, P.Path.mkdir

        def refused(path):
            if Path(path).name.startswith(".out"):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(P.os, "open", lambda path, *a, **kw: refused(path) or real_open(path, *a, **kw))
        monkeypatch.setattr(
            P.Path, "mkdir", lambda self, *a, **kw: refused(self) or real_mkdir(self, *a, **kw)
        )
        says = "Read-only file system"
    else:

        def rotate(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(S.ShardWriter, "_rotate", rotate)
        says = "No space left on device"
    err = _one_line_exit_2(capsys, ["data", "prepare", str(text), "--out", str(out), "--vocab-size", str(VOCAB)],
                           f"cannot write --out '{out}' ({says}); ")  # fmt: skip
    assert f"free in '{tmp_path}': free space or fix its permissions, or give another --out" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_a_tokenizer_directory_file_that_is_a_fifo_is_named_not_read(tmp_path):
    """A FIFO where tokenizer_config.json (or tokenizer.json) should be is refused in one line, naming it;
    it was taken as absent (tokenizer_config.json: the tokenizer then read without its special tokens)."""
    from meshkit.data.tokenizer import load_tokenizer

    llama3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"
    tok = tmp_path / "tok"
    shutil.copytree(llama3, tok)
    (tok / "tokenizer_config.json").unlink()
    os.mkfifo(tok / "tokenizer_config.json")
    with pytest.raises(DataError, match=r"tokenizer_config.json' is a FIFO \(named pipe\), not a file"):
        load_tokenizer(tok)
    (tok / "tokenizer_config.json").unlink()
    (tok / "tokenizer.json").rename(tok / "real.json")
    os.mkfifo(tok / "tokenizer.json")
    with pytest.raises(DataError, match=r"tokenizer.json' is a FIFO \(named pipe\), not a file"):
        load_tokenizer(tok)
