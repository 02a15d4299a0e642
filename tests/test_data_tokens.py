"""Token data (issue 25): `meshkit data prepare` (BPE, shards, manifest), the tokenizer's round trip,
packing that keeps every token of every document exactly once per epoch, the grain pipeline's exact
resume with another process count, and bad input as one line with exit 2 and nothing written."""

import json

import numpy as np
import pytest

from meshkit.cli import main
from meshkit.data import DataError, load
from meshkit.data import shards as S
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents
from meshkit.data.tokenizer import EOT, load_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Twelve documents of Python's reference docs (about 60 kB) as files, prepared into small shards."""
    root = tmp_path_factory.mktemp("corpus")
    texts = [t for t in default_documents() if 1000 < len(t) < 12000][:12]
    texts[3] += f" a literal {EOT} inside a document, and ünïcödé ✓"
    for i, t in enumerate(texts):
        (root / "text" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (root / "text" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    prepare([str(root / "text")], root / "data", vocab_size=VOCAB, shard_tokens=4000)
    return root, texts


def _docs(directory):
    """The documents in the shards, as id arrays (each without its end-of-text)."""
    _, stream, tok = S.open_shards(directory)
    ids = stream.read(0, len(stream))
    ends = S.documents(directory)
    starts = np.concatenate([[0], ends[:-1]])
    assert np.all(ids[ends - 1] == tok.eot_id)
    return [ids[a : b - 1] for a, b in zip(starts, ends, strict=True)], tok


def test_prepare_writes_shards_a_manifest_and_a_tokenizer_that_round_trips(corpus):
    root, texts = corpus
    manifest = json.loads((root / "data" / S.MANIFEST).read_text())
    assert manifest["documents"] == len(texts) and manifest["vocab_size"] == VOCAB
    assert len(manifest["shards"]) > 1 and sum(s["tokens"] for s in manifest["shards"]) == manifest["tokens"]
    assert manifest["text_bytes"] == sum(len(t.encode()) for t in texts)
    docs, tok = _docs(root / "data")
    assert [tok.decode(d) for d in docs] == texts  # every document, exactly, in order
    assert EOT in tok.decode(docs[3]) and not np.any(docs[3] == tok.eot_id)  # text, not a boundary
    assert sum(int(tok.token_bytes[d].sum()) for d in docs) == manifest["text_bytes"]  # bits per byte's bytes


def test_packing_keeps_every_token_of_every_document_once_per_epoch(corpus):
    root, _ = corpus
    data = load(str(root / "data"))
    seq = 64
    stream = data.batches(seq_len=seq, global_batch=4, seed=7, process_index=0, process_count=1)
    train = data.train.read(0, len(data.train))
    for epoch in range(2):
        first = epoch * stream.windows
        order = [int(stream._order[first + i]) for i in range(stream.windows)]
        assert sorted(order) == list(range(stream.windows))  # each window once per epoch, shuffled
        assert order != sorted(order)
        by_place = dict(zip(order, (stream.window(first + i) for i in range(stream.windows)), strict=True))
        assert all(w.shape == (seq + 1,) for w in by_place.values())
        assert all(np.array_equal(by_place[k][-1], by_place[k + 1][0]) for k in range(stream.windows - 1))
        inputs = np.concatenate([by_place[k][:-1] for k in range(stream.windows)])
        n = min(len(train), len(inputs))
        assert n >= len(train) - 1  # only the final end-of-text may be a target alone
        assert np.array_equal(inputs[:n], train[:n])  # the stream, each token once
        assert np.all(inputs[n:] == data.pad_id)  # then end-of-text padding only


def _take(batches, n):
    return [next(batches) for _ in range(n)]


def test_resume_is_exact_with_another_process_count(corpus):
    data = load(str(corpus[0] / "data"))
    kw = dict(seq_len=32, global_batch=8, seed=3)
    straight = _take(data.batches(**kw, process_index=0, process_count=1, threads=2), 6)
    first = data.batches(**kw, process_index=0, process_count=1, threads=2)
    head = _take(first, 2)
    state = json.loads(json.dumps(first.state))
    first.close()
    assert state["batch"] == 2 and state["packed"] and state["data"] == data.digest
    parts = []
    for p in range(2):  # the run goes on with two processes, each reading its half
        resumed = data.batches(**kw, process_index=p, process_count=2, threads=2)
        resumed.restore(state)
        parts.append(_take(resumed, 4))
        resumed.close()
    for b in range(4):
        for k in range(2):
            joined = np.concatenate([parts[0][b][k], parts[1][b][k]])
            assert np.array_equal(joined, straight[2 + b][k])
    assert all(
        np.array_equal(x, y) for h, s in zip(head, straight, strict=False) for x, y in zip(h, s, strict=True)
    )
    other = load(str(corpus[0] / "data")).batches(**{**kw, "seed": 4}, process_index=0, process_count=1)
    with pytest.raises(DataError, match="seed=3 but this run has seed=4"):
        other.restore(state)


def _one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"a.txt": b""}, "is empty"),
        ({"a.txt": b"text", "b.bin": b"\x7fELF\x00\x01\x02"}, "is binary (a NUL byte at offset 4)"),
        (
            {"a.txt": "caf\u00e9".encode(), "b.txt": "caf\u00e9".encode("latin-1")},
            "b.txt' is not UTF-8 text (byte 0xe9 at offset 3)",
        ),
        ({"a.txt": "caf\u00e9".encode()[:-1]}, "a.txt' is not UTF-8 text (byte 0xc3 at offset 3)"),
    ],
)
def test_bad_text_is_one_line_and_writes_nothing(tmp_path, capsys, files, match):
    for name, raw in files.items():
        (tmp_path / "in" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_bytes(raw)
    _one_line_exit_2(
        capsys,
        ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--vocab-size", "300"],
        match,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no --out, no partial directory


def test_bad_tokenizers_and_outputs_are_one_line(corpus, tmp_path, capsys):
    root, _ = corpus
    text = root / "text" / "00.txt"
    no_eot = tmp_path / "no_eot.json"
    tok = json.loads((root / "data" / S.TOKENIZER).read_text())
    tok["added_tokens"] = []
    del tok["model"]["vocab"][EOT]
    no_eot.write_text(json.dumps(tok))
    (tmp_path / "junk.json").write_text("{not json")
    out = ["--out", str(tmp_path / "out")]
    _one_line_exit_2(
        capsys, ["data", "prepare", str(text), *out, "--tokenizer", str(no_eot)], f"has no {EOT} token"
    )
    _one_line_exit_2(
        capsys,
        ["data", "prepare", str(text), *out, "--tokenizer", str(tmp_path / "junk.json")],
        "is not a tokenizer.json",
    )
    _one_line_exit_2(capsys, ["data", "prepare", str(text), *out, "--tokenizer", str(root / "data" / S.TOKENIZER),
                              "--vocab-size", "512"], f"--vocab-size 512 does not match the {VOCAB} ids")  # fmt: skip
    _one_line_exit_2(
        capsys, ["data", "prepare", str(text), "--out", str(root / "data")], "already holds prepared data"
    )
    _one_line_exit_2(
        capsys, ["data", "prepare", str(text), *out, "--vocab-size", "100"], "--vocab-size 100 is below 257"
    )
    _one_line_exit_2(  # tokenizers would abort the process (in Rust) on such a size
        capsys,
        ["data", "prepare", str(text), *out, "--vocab-size", str(10**11)],
        "is above 16,777,216 (2**24",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.json", "no_eot.json"]
    from meshkit.data.tokenizer import train_bpe

    with pytest.raises(
        DataError, match="is above 16,777,216"
    ):  # the library's caller too, not only the CLI's
        train_bpe(["text"], 10**11)
    # an existing tokenizer: nothing trained, the same ids
    assert main(["data", "prepare", str(text), *out, "--tokenizer", str(root / "data" / S.TOKENIZER)]) == 0
    assert "prepared" in capsys.readouterr().out
    again = load_tokenizer(tmp_path / "out" / S.TOKENIZER)
    assert again.to_str() == load_tokenizer(root / "data" / S.TOKENIZER).to_str()


def test_data_that_does_not_match_its_manifest_is_refused(corpus, tmp_path, capsys):
    import shutil

    root, _ = corpus
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    run = ["train", "--preset", "tiny", "--data", str(data), "--run-dir", str(tmp_path / "run")]
    tok = json.loads((data / S.TOKENIZER).read_text())
    tok["model"]["vocab"]["zzz-extra"] = VOCAB
    (data / S.TOKENIZER).write_text(json.dumps(tok))
    _one_line_exit_2(capsys, run, "is not the tokenizer the shards were made with")
    shutil.copy(root / "data" / S.TOKENIZER, data / S.TOKENIZER)
    with open(data / "shard-00001.bin", "ab") as f:
        f.write(b"\0\0")
    _one_line_exit_2(capsys, run, "shard-00001.bin' is 8002 bytes, the manifest says 8000 bytes")
    _one_line_exit_2(
        capsys, [*run[:-4], "--data", str(root / "text"), *run[-2:]], "is a directory without a manifest.json"
    )
    assert not (tmp_path / "run").exists()
