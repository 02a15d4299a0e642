"""`meshkit data prepare` from JSONL, Parquet and Hugging Face datasets directories (a document per row):
the ids equal those of the same texts as text files, a datasets directory written by `datasets` itself
reads as its texts, the readers never hold a whole file, and bad rows are one line naming file:line."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from meshkit.cli import main
from meshkit.data import readers
from meshkit.data import shards as S
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents

FIXTURE = Path(__file__).parent / "fixtures" / "hf_datasets"
VOCAB = 300


def _texts() -> list[str]:
    texts = [t for t in default_documents() if 500 < len(t) < 4000][:8]
    texts[2] += "\n ünïcödé ✓ and a tab\there"
    return texts


def _text_files(root: Path, texts: list[str]) -> Path:
    (root / "text").mkdir(parents=True)
    for i, t in enumerate(texts):
        (root / "text" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    return root / "text"


def _jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    lines = [json.dumps({"id": i, field: t, "meta": {"n": i}}) for i, t in enumerate(texts)]
    path.write_text(
        "\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n", encoding="utf-8"
    )  # a blank line
    return path


def _parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    table = pa.table({"id": list(range(len(texts))), field: texts})
    pq.write_table(table, path, row_group_size=3)  # several row groups
    return path


def _datasets_dir(root: Path, splits: dict[str, list[str]], column: str = "text") -> Path:
    """A DatasetDict as ``save_to_disk`` lays it out (dataset_dict.json; per split state.json,
    dataset_info.json and Arrow IPC stream files), written with pyarrow: two shards, large strings."""
    root.mkdir()
    (root / readers.DATASET_DICT).write_text(json.dumps({"splits": list(splits)}))
    for split, texts in splits.items():
        (root / split).mkdir()
        table = pa.table({column: pa.array(texts, pa.large_string()), "id": list(range(len(texts)))})
        half, files = len(texts) // 2, []
        for i, part in enumerate([table.slice(0, half), table.slice(half)]):
            name = f"data-{i:05d}-of-00002.arrow"
            with pa.OSFile(str(root / split / name), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
                for batch in part.to_batches(max_chunksize=2):
                    w.write_batch(batch)
            files.append({"filename": name})
        (root / split / readers.DATASET_STATE).write_text(json.dumps({"_data_files": files, "_split": None}))
        (root / split / readers.DATASET_INFO).write_text(
            json.dumps({"features": {column: {"dtype": "large_string"}}})
        )
    return root


def _ids(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    _, stream, _ = S.open_shards(directory)
    return stream.read(0, len(stream)), S.documents(directory)


def _docs(directory: Path) -> list[str]:
    ids, ends = _ids(directory)
    _, _, tok = S.open_shards(directory)
    starts = np.concatenate([[0], ends[:-1]])
    return [tok.decode(ids[a : b - 1]) for a, b in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("piece", [readers.PIECE, 300], ids=["whole", "cut-in-pieces"])
def test_rows_give_the_ids_of_the_same_texts_as_files(tmp_path, monkeypatch, piece):
    monkeypatch.setattr(readers, "PIECE", piece)  # 300: every document encoded in several pieces
    monkeypatch.setattr(readers, "CHUNK", 257)  # text files read in odd chunks
    texts = _texts()
    files = _text_files(tmp_path, texts)
    sources = {
        "jsonl": _jsonl(tmp_path / "t.jsonl", texts),
        "parquet": _parquet(tmp_path / "t.parquet", texts),
        "datasets": _datasets_dir(tmp_path / "ds", {"train": texts, "test": ["other"]}),
    }
    base = prepare([str(files)], tmp_path / "from-text", vocab_size=VOCAB)
    want = _ids(tmp_path / "from-text")
    for name, path in sources.items():
        # trained here from the rows: the same tokenizer, the same ids
        manifest = prepare([str(path)], tmp_path / name, vocab_size=VOCAB)
        assert (tmp_path / name / S.TOKENIZER).read_text() == (
            tmp_path / "from-text" / S.TOKENIZER
        ).read_text()
        got = _ids(tmp_path / name)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), name
        assert {k: manifest[k] for k in ("documents", "tokens", "text_bytes")} == {
            k: base[k] for k in ("documents", "tokens", "text_bytes")
        }
        assert manifest["text_field"] == "text" and manifest["skipped_rows"] == 0
    assert "text_field" not in base and base["skipped_rows"] == 0
    assert _docs(tmp_path / "parquet") == texts


def test_a_datasets_directory_written_by_datasets_reads_as_its_texts(tmp_path, capsys):
    """The fixture was written by ``datasets`` 2.14.4's save_to_disk (tests/fixtures/hf_datasets/make.py)."""
    want = json.loads((FIXTURE / "texts.json").read_text(encoding="utf-8"))
    assert (
        main(
            [
                "data",
                "prepare",
                str(FIXTURE / "dict"),
                "--out",
                str(tmp_path / "train"),
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    assert "4 documents (1 rows without text skipped)" in capsys.readouterr().out
    assert _docs(tmp_path / "train") == [t for t in want["train"] if t]  # the empty row skipped
    tok = str(tmp_path / "train" / S.TOKENIZER)
    prepare([str(FIXTURE / "dict")], tmp_path / "test", tokenizer=tok, split="test")
    assert _docs(tmp_path / "test") == want["test"]
    prepare([str(FIXTURE / "one")], tmp_path / "one", tokenizer=tok, text_field="content")
    files = tmp_path / "files"
    files.mkdir()
    for i, t in enumerate(want["one"]):
        (files / f"{i}.txt").write_text(t, encoding="utf-8")
    prepare([str(files)], tmp_path / "one-files", tokenizer=tok)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(_ids(tmp_path / "one"), _ids(tmp_path / "one-files"), strict=True)
    )
    manifest = json.loads((tmp_path / "one" / S.MANIFEST).read_text())
    assert manifest["inputs"] == [str(FIXTURE / "one")] and manifest["text_field"] == "content"


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_row_files_are_read_a_record_batch_at_a_time(tmp_path, monkeypatch, kind):
    """pyarrow's allocations while every row of an 8 MB column is read (100 rows a batch: 0.4 MB) stay
    under a quarter of it (measured 1.2 MB from Parquet; the file read whole allocates more than all of it)."""
    monkeypatch.setattr(readers, "ROWS", 100)
    texts = [f"row {i} " + "x" * 4000 for i in range(2000)]
    if kind == "parquet":
        pq.write_table(pa.table({"text": texts}), tmp_path / "big.parquet", row_group_size=50)
        inputs = readers.list_inputs([str(tmp_path / "big.parquet")])
    else:
        inputs = readers.list_inputs([str(_datasets_dir(tmp_path / "ds", {"train": texts}))])
    before, peak, seen = pa.total_allocated_bytes(), 0, []
    for piece, _, _ in readers.Reader(inputs).pieces():
        peak = max(peak, pa.total_allocated_bytes() - before)
        seen.append(piece)
    assert seen == texts
    assert 0 < peak < sum(map(len, texts)) / 4, peak


def _one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


BAD_LINES = {
    "not json": ('{"text": "a"}\n{"text": "b",\n', "bad.jsonl:2' is not JSON (Expecting property name"),
    "not an object": ('{"text": "a"}\n\n["b"]\n', "bad.jsonl:3' is a JSON list, not an object"),
    "no field": (
        '{"text": "a"}\n{"body": "b", "id": 1}\n',
        "bad.jsonl:2' has no field 'text' (its fields: body, id)",
    ),
    "not text": ('{"text": 3}\n', "bad.jsonl:1': field 'text' is a JSON int, not text"),
    "not utf-8": (b'{"text": "caf\xe9"}\n', "bad.jsonl:1' is not UTF-8 (byte 0xe9 at column 14)"),
    "no rows": ("\n\n", "bad.jsonl' holds no JSON lines"),
    "no text at all": ('{"text": ""}\n{"text": null}\n', "the inputs hold no text (2 rows, every one empty)"),
    "lone surrogate": (
        '{"text": "fine \\ud83d\\ude00"}\n{"text": "a \\ud800 alone"}\n',
        "bad.jsonl:2': text holds a lone UTF-16 surrogate (\\ud800 at character 2)",
    ),
    "nested too deeply": ("[" * 100_000 + "]" * 100_000 + "\n", "bad.jsonl:1' is nested too deeply to read"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_jsonl_line_is_one_line_naming_file_and_line(tmp_path, capsys, case):
    content, match = BAD_LINES[case]
    bad = tmp_path / "in" / "bad.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    _one_line_exit_2(capsys, ["data", "prepare", str(bad.parent), "--out", str(tmp_path / "out")], match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # nothing written


def test_bad_parquet_and_datasets_inputs_are_one_line(tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")]
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "a.parquet")
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "a.parquet"), *out],
                     "a.parquet' has no column 'text' (its text columns: body): give --text-field")  # fmt: skip
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "a.parquet"), "--text-field", "n", *out],
                     "column 'n' holds int64, not text")  # fmt: skip
    not_utf8 = pa.array([b"fine", b"ok", b"\xff\xfe"], pa.binary()).view(pa.string())  # Arrow need not check
    pq.write_table(pa.table({"text": not_utf8}), tmp_path / "b.parquet", row_group_size=2)
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "b.parquet"), *out],
                     "b.parquet' row 3: column 'text' is not UTF-8 (byte 0xff at offset 0)")  # fmt: skip
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "junk.parquet"), *out], "cannot read")
    _one_line_exit_2(capsys, ["data", "prepare", str(FIXTURE / "dict"), "--split", "validation", *out],
                     "has no split 'validation' (its splits: train, test): give --split")  # fmt: skip
    broken = tmp_path / "broken"
    shutil.copytree(FIXTURE / "one", broken)
    (broken / "data-00000-of-00001.arrow").unlink()
    _one_line_exit_2(capsys, ["data", "prepare", str(broken), *out], "data-00000-of-00001.arrow' is missing")
    assert not (tmp_path / "out").exists()


def test_row_options_where_no_input_has_rows_are_refused_not_ignored(tmp_path, capsys):
    """``--text-field`` and ``--split`` would do nothing on text files: refused in one line instead."""
    (tmp_path / "a.txt").write_text("some text\n")
    out = ["--out", str(tmp_path / "out")]
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "a.txt"), "--text-field", "body", *out],
                     "--text-field body names a column of JSONL, Parquet or datasets rows, but every input is text")  # fmt: skip
    _one_line_exit_2(capsys, ["data", "prepare", str(tmp_path / "a.txt"), "--split", "test", *out],
                     "--split test chooses a datasets directory's split, but no input is one")  # fmt: skip
    assert not (tmp_path / "out").exists()
