"""Prompts for GRPO: ``meshkit data prepare --chat`` reads TRL's prompt rows (``prompt`` alone, a string or
messages) into a document each, the ids the model is given to answer (a template's render with the
generation prompt, exactly ``Encoder.prompt_ids``; a string the tokenizer's BOS framing and its text, no
end of text) with a mask of 0s, and ``rows.jsonl`` holding each row as read (every column, also from
Parquet and datasets directories); ``Prompts`` reads them back, holds out the last tenth and deals them
out per rollout in a seeded order, every prompt once an epoch, a function of the step alone; a bad row,
a column JSON cannot hold or a mix of kinds is one line and leaves nothing written; prompt data is never
packed as conversations nor mixed."""

import datetime
import json
from pathlib import Path

import numpy as np
import pytest

from meshkit.data.chat import Encoder
from meshkit.data.chat_template import load_template
from meshkit.data.corpus import load
from meshkit.data.packing import Packing, PairRows
from meshkit.data.prepare import prepare
from meshkit.data.prepare_chat import summary
from meshkit.data.prompts import ROWS, Prompts, held_out
from meshkit.data.source import DataError
from meshkit.data.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "corpus" / "chat_templates"
LLAMA3, QWEN3, GEMMA2 = TEMPLATES / "llama3", TEMPLATES / "qwen3", TEMPLATES / "gemma2"
SYSTEM, USER = (
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2+3?"},
)
STRINGS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3} for i in range(8)]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _prepare(tmp_path: Path, rows: list, tokenizer: Path = LLAMA3, name: str = "in.jsonl") -> dict:
    return prepare(
        [str(_jsonl(tmp_path / name, rows))], tmp_path / "out", tokenizer=str(tokenizer), chat=True
    )


def test_string_prompts_are_the_tokenizers_framing_and_rows_jsonl_keeps_every_other_column(tmp_path):
    m = _prepare(tmp_path, STRINGS, GEMMA2)  # Gemma 2's tokenizer prepends a BOS
    assert m["documents"] == len(STRINGS) and m["chat"]["learnt_tokens"] == 0
    assert m["chat"]["prompts"]["count"] == len(STRINGS) and "preference" not in m["chat"]
    assert "none of them learnt (prompts to answer" in summary(m) and "rows.jsonl" in summary(m)
    tok = load_tokenizer(GEMMA2)
    assert tok.prefix and tok.suffix
    every = Prompts.open(tmp_path / "out")
    assert len(every) == len(STRINGS)
    for i, row in enumerate(STRINGS):
        ids = every.ids(i)
        assert ids.dtype == np.int32 and ids.tolist() == [*tok.prefix, *tok.encode(row["prompt"]).tolist()]
        assert tok.decode(ids[len(tok.prefix) :]) == row["prompt"]  # no end of text after it
        assert every.prompt(i) == row["prompt"] and every.row(i) == {
            "answer": row["answer"],
            "level": row["level"],
        }
    lines = (tmp_path / "out" / ROWS).read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == STRINGS  # each row as read, in the documents' order
    corpus = load(str(tmp_path / "out"))
    assert corpus.prompts and corpus.chat and not corpus.preference
    for src in (corpus.train, corpus.held_out):  # the documents' masks: nothing learnt
        assert not src.masks.read(int(src.starts[0]), int(src.ends[-1])).any()
    train, held = corpus.prompt_set(), corpus.prompt_set(held_out=True)
    assert (len(train), len(held)) == (7, 1) and held.prompt(0) == STRINGS[-1]["prompt"]
    assert train.ids(3).tolist() == every.ids(3).tolist() and held.row(0) == every.row(7)
    assert corpus.train.documents == 7 and corpus.held_out.documents == 1


@pytest.mark.parametrize("template", [LLAMA3, QWEN3], ids=["llama3", "qwen3"])
def test_message_prompts_are_the_encoders_prompt_ids(tmp_path, template):
    prompts = [[USER], [SYSTEM, USER], [USER, {"role": "assistant", "content": "5"}, USER]]
    rows = [{"prompt": p, "answer": 5, "tags": ["math", str(i)]} for i, p in enumerate(prompts)]
    m = _prepare(tmp_path, rows, template)
    enc = Encoder(load_tokenizer(template), load_template(template))
    got = Prompts.open(tmp_path / "out")
    for i, p in enumerate(prompts):
        want = enc.prompt_ids(p)
        assert got.ids(i).tolist() == want.tolist() and got.prompt(i) == p
        assert got.row(i) == {"answer": 5, "tags": ["math", str(i)]}
    assert m["tokens"] == sum(len(enc.prompt_ids(p)) for p in prompts)


def _datasets_dir(root: Path, rows: list[dict]) -> Path:
    """A dataset as ``save_to_disk`` lays it out: state.json naming an Arrow IPC stream file, and its info."""
    import pyarrow as pa

    root.mkdir()
    table = pa.Table.from_pylist(rows)
    with (
        pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as f,
        pa.ipc.new_stream(f, table.schema) as w,
    ):
        w.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (root / "dataset_info.json").write_text("{}")
    return root


def test_parquet_and_datasets_prompt_rows_keep_every_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**r, "meta": {"source": "gsm", "id": i}} for i, r in enumerate(STRINGS)]
    pq.write_table(pa.Table.from_pylist(rows[:5]), tmp_path / "a.parquet")
    ds = _datasets_dir(tmp_path / "ds", rows[5:])
    m = prepare([str(tmp_path / "a.parquet"), str(ds)], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert m["chat"]["prompts"]["count"] == len(rows)
    got = Prompts.open(tmp_path / "out")
    assert [got.row(i) for i in range(len(rows))] == [
        {k: v for k, v in r.items() if k != "prompt"} for r in rows
    ]
    # a column JSON cannot hold is refused, naming the row and the column
    dated = [{"prompt": "p", "when": datetime.date(2024, 1, 1)}]
    pq.write_table(pa.Table.from_pylist(dated), tmp_path / "d.parquet")
    with pytest.raises(
        DataError, match=r"'.*d.parquet row 1': column 'when' holds a value JSON cannot hold \(date"
    ):
        prepare([str(tmp_path / "d.parquet")], tmp_path / "bad", tokenizer=str(LLAMA3), chat=True)
    assert not (tmp_path / "bad").exists() and not list(tmp_path.glob(".bad.partial-*"))
    # a table with an answer column is read from its chat columns only: a prompt row there is refused
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "p", "completion": None, "answer": "1"}]), tmp_path / "n.parquet"
    )
    with pytest.raises(
        DataError, match=r"'.*n.parquet row 1' is a prompt row \(its completion null\) in a table"
    ):
        prepare([str(tmp_path / "n.parquet")], tmp_path / "bad", tokenizer=str(LLAMA3), chat=True)


def test_held_out_is_about_a_tenth_at_the_end_and_one_each_side():
    assert [held_out(n) for n in (0, 1, 2, 3, 9, 10, 14, 15, 25, 100)] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 10]
    assert all(n - held_out(n) > 0 and (n < 2 or held_out(n) >= 1) for n in range(1, 200))


def test_rollout_batches_take_every_prompt_once_an_epoch_by_seed_and_resume_from_the_step(tmp_path):
    _prepare(tmp_path, [{"prompt": f"q{i}", "answer": i} for i in range(12)])
    train, held = load(str(tmp_path / "out")).prompt_set(), load(str(tmp_path / "out")).prompt_set(True)
    assert (len(train), len(held)) == (11, 1)
    n = len(train)
    for size in (
        1,
        4,
        11,
    ):  # dividing the epoch or not: the stream of batches is every prompt, epoch by epoch
        stream = [i for step in range(3 * n) for i in train.batch(step, size, seed=7)]
        epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    assert train.epoch(5, 4) == 1 and train.epoch(2, 4) == 0
    fresh = Prompts.open(tmp_path / "out").split()[0]  # a resumed run: step 9 alone, nothing drawn before
    assert fresh.batch(9, 4, seed=7) == train.batch(9, 4, seed=7)
    assert train.batch(0, 11, seed=8) != train.batch(0, 11, seed=7)
    with pytest.raises(DataError, match=r"data seed must be in \[0, 2\*\*32\), got -1"):
        train.batch(0, 4, seed=-1)
    with pytest.raises(DataError, match="a rollout batch needs 1 or more prompts"):
        train.batch(0, 0, seed=1)


USER_ANSWER = [USER, {"role": "assistant", "content": "5"}]
BAD = [
    ("empty", [{"prompt": ""}], r"'X:1': 'prompt' is empty: nothing to answer; fix or remove the row"),
    (
        "a-number",
        [STRINGS[0], {"prompt": 7}],
        r"'X:2': 'prompt' is a int, not a string or a list of \{role, content\} messages: fix or remove the row",
    ),
    ("no-messages", [{"prompt": []}], r"'X:1': 'prompt' is empty, not a list of \{role, content\} messages"),
    (
        "ends-answered",
        [{"prompt": USER_ANSWER}],
        r"'X:1': 'prompt' ends with the assistant's message: a prompt gives the model a turn to answer",
    ),
    (
        "opens-answered",
        [{"prompt": USER_ANSWER[::-1]}],
        r"'X:1': 'prompt' opens with the assistant's message",
    ),
    ("a-role", [{"prompt": [{"role": "robot", "content": "x"}]}], r"'X:1': prompt\[0\] has the role 'robot'"),
    (
        "reserved",
        [{"prompt": "p", "completions": 3}],
        r"'X:1' has a column 'completions', the name of an argument a reward function is given itself",
    ),
    (
        "nan",
        [{"prompt": "p", "score": float("nan")}],
        r"'X:1': column 'score' holds a value JSON cannot hold \(NaN",
    ),
    (
        "then-a-conversation",
        [STRINGS[0], {"prompt": "p", "completion": "c"}],
        r"'X:2' is not a prompt to answer \('prompt' alone, for --task grpo\), and the rows from 'X:1' on are: "
        r"prepare prompts and other rows apart \(each with its own --out\)",
    ),
    (
        "after-a-conversation",
        [{"messages": USER_ANSWER}, STRINGS[0]],
        r"'X:2' is a prompt to answer .*, and the rows from 'X:1' on are not: prepare prompts and other rows apart",
    ),
    (
        "after-a-pair",
        [{"prompt": "p", "chosen": "a", "rejected": "b"}, STRINGS[0]],
        r"'X:2' is a prompt to answer .*, and the rows from 'X:1' on are not",
    ),
    (
        "then-a-pair",
        [STRINGS[0], {"prompt": "p", "chosen": "a", "rejected": "b"}],
        r"'X:2' is not a prompt to answer .*, and the rows from 'X:1' on are",
    ),
]


@pytest.mark.parametrize(("rows", "said"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_prompt_row_is_one_line_naming_it_and_nothing_is_written(tmp_path, rows, said):
    src = _jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(DataError, match=said.replace("X", str(src))) as e:
        prepare([str(src)], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_prompt_data_is_neither_packed_nor_mixed_and_its_rows_are_checked(tmp_path, capsys):
    from meshkit.cli import main

    src = _jsonl(tmp_path / "p.jsonl", STRINGS)
    assert (
        main(
            ["data", "prepare", str(src), "--chat", "--tokenizer", str(LLAMA3), "--out", str(tmp_path / "a")]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert f"{len(STRINGS)} prompts" in said and "--task grpo" in said
    corpus = load(str(tmp_path / "a"))
    for rows in (Packing, PairRows):
        with pytest.raises(
            DataError, match=r"the data holds prompts to answer .*: train on them with --task grpo"
        ):
            rows(corpus.train, 32, 0)
    prepare([str(src)], tmp_path / "b", tokenizer=str(LLAMA3), chat=True)
    with pytest.raises(DataError, match=r"--data: 'a' holds prompts, which a mixture does not draw from"):
        load(f"{tmp_path / 'a'}:1,{tmp_path / 'b'}:1")
    conversations = _jsonl(tmp_path / "c.jsonl", [{"messages": USER_ANSWER}] * 2)
    prepare([str(conversations)], tmp_path / "c", tokenizer=str(LLAMA3), chat=True)
    with pytest.raises(DataError, match=r"holds no prompts: prepare rows of 'prompt' alone"):
        load(str(tmp_path / "c")).prompt_set()
    with pytest.raises(DataError, match=r"'.*c' holds no prompts"):
        Prompts.open(tmp_path / "c")
    rows = tmp_path / "b" / ROWS
    rows.write_text(rows.read_text().replace('"answer": "2"', '"answer": "3"'))
    with pytest.raises(
        DataError, match=r"rows.jsonl' is not the rows the prompts were prepared with .*: prepare"
    ):
        load(str(tmp_path / "b"))
