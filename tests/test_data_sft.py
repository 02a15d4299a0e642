"""Fine-tuning data (issue 37): ``meshkit data prepare --chat`` writes a conversation per document and a
loss mask beside the ids; the batch stream packs whole conversations into rows and yields TokenBatches
whose weights make the plain mean of ``token_loss * weights`` the global masked mean, with segment ids
and positions reset per document, resuming exactly and split over processes; plain windows get
document masks from their end-of-text ids."""

import json
from pathlib import Path

import numpy as np
import pytest

from meshkit.data.corpus import load
from meshkit.data.packing import ChatSource, first_fit
from meshkit.data.pipeline import Batches
from meshkit.data.prepare import prepare
from meshkit.data.source import ArraySource, DataError
from meshkit.spec.batch import TokenBatch

LLAMA3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"
SEQ = 32


def _docs(n: int = 120, seed: int = 0, masked: float = 0.4) -> ChatSource:
    """Random conversations: ids that name their document (doc d's ids are 1000 * (d + 1) + position),
    a random mask; one longer than a row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 24, n)
    lengths[7] = 3 * SEQ
    ends = np.cumsum(lengths)
    starts = ends - lengths
    ids = np.concatenate([1000 * (d + 1) + np.arange(k) for d, k in enumerate(lengths)]).astype(np.int32)
    mask = (rng.random(len(ids)) < masked).astype(np.int32)
    return ChatSource(ArraySource(ids), ArraySource(mask), starts, ends)


def _stream(src: ChatSource, **kw) -> Batches:
    kw = {
        "seq_len": SEQ,
        "global_batch": 4,
        "seed": 3,
        "pad_id": 0,
        "process_index": 0,
        "process_count": 1,
    } | kw
    return Batches(src, **kw)


def test_first_fit_places_each_document_in_the_first_row_with_room():
    lengths = np.array([5, 7, 4, 3, 8, 2, 6])
    rows = first_fit(lengths, 10)
    room = []
    for need, row in zip(lengths.tolist(), rows.tolist(), strict=True):
        first = next((r for r, left in enumerate(room) if left >= need), len(room))
        assert row == first
        room += [10] * (first + 1 - len(room))
        room[first] -= need
    assert rows.tolist() == [0, 1, 0, 1, 2, 2, 3]


def test_rows_hold_whole_conversations_with_their_segments_and_positions():
    src = _docs()
    b = _stream(src)
    p = b.packing
    assert p.truncated == 1 and p.summary["truncated"] == 1 and 0.5 < p.summary["fill"] <= 1
    seen = []
    for w in range(p.rows):
        ids, (seg, pos) = p.tokens(w), p.layout(w)
        for k in range(1, seg.max() + 1):
            doc_ids = ids[seg == k]
            d = int(doc_ids[0]) // 1000 - 1
            whole = min(int(src.ends[d] - src.starts[d]), SEQ + 1)
            assert doc_ids.tolist() == (1000 * (d + 1) + np.arange(whole)).tolist()  # whole, in order
            assert pos[seg == k].tolist() == list(range(whole))
            seen.append(d)
        assert (ids[seg == 0] == 0).all() and (np.diff(seg[seg > 0]) >= 0).all()  # padding at the end
    assert sorted(seen) == list(range(src.documents))  # every conversation exactly once
    x = next(b)
    assert isinstance(x, TokenBatch) and all(a.shape == (4, SEQ) for a in x[:5]) and x.reference is None
    assert x.weights.dtype == np.float32 and x.segment_ids.dtype == np.int32


def test_a_target_is_learnt_where_its_mask_is_set_within_the_inputs_document():
    src = _docs()
    p = _stream(src).packing
    full_mask = src.masks.read(0, len(src.masks))
    for w in range(p.rows):
        ids, (seg, _) = p.tokens(w), p.layout(w)
        want = np.zeros(SEQ, np.uint8)
        for t in range(SEQ):
            if seg[t + 1] > 0 and seg[t + 1] == seg[t]:
                d = int(ids[t + 1]) // 1000 - 1
                want[t] = full_mask[src.starts[d] + int(ids[t + 1]) % 1000]
        assert p.target_mask(w).tolist() == want.tolist()


def test_weights_make_the_plain_mean_the_global_masked_mean_on_every_split():
    """mean(token_loss * weights) over the global batch equals sum(token_loss * mask) / sum(mask) (NumPy
    float64), whichever process holds which rows; a global batch with nothing to learn weighs nothing."""
    src = _docs()
    one = _stream(src, global_batch=8)
    halves = [_stream(src, global_batch=8, process_index=p, process_count=2) for p in range(2)]
    rng = np.random.default_rng(1)
    for _ in range(5):
        whole = next(one)
        parts = [next(h) for h in halves]
        for field in range(5):
            joined = np.concatenate([p[field] for p in parts])
            assert np.array_equal(joined, whole[field]), field  # the processes' rows are the global batch
        loss = rng.random(whole.inputs.shape)
        mask = whole.weights > 0
        masked_mean = (loss * mask).sum() / mask.sum()
        assert abs(np.mean(loss * whole.weights.astype(np.float64)) - masked_mean) <= 1e-6 * masked_mean
        assert np.allclose(whole.weights[mask], mask.size / mask.sum())
    nothing = ChatSource(src.tokens, ArraySource(np.zeros(len(src.masks), np.int32)), src.starts, src.ends)
    x = next(_stream(nothing))
    assert not x.weights.any() and x.weights.shape == (4, SEQ)


@pytest.mark.parametrize("threads", [0, 2])
def test_exact_resume(threads):
    src = _docs()
    a = _stream(src, threads=threads)
    for _ in range(3):
        next(a)
    state = a.state
    assert state["chat"] is True and state["batch"] == 3
    after = [next(a) for _ in range(40)]  # past an epoch of rows: reshuffled
    b = _stream(src, threads=threads)
    b.restore(json.loads(json.dumps(state)))
    for x, y in zip(after, (next(b) for _ in range(40)), strict=True):
        assert all(np.array_equal(u, v) for u, v in zip(x, y, strict=True))
    a.close()
    b.close()
    with pytest.raises(DataError, match="chat="):
        _stream(_docs(), seed=3).restore({**state, "chat": None})


def test_plain_windows_get_document_masks_from_end_of_text():
    eot = 9
    ids = np.array([1, 2, eot, 3, 4, 5, eot, 6, eot, 7, 8, 1, 2, eot] * 4, np.int32)
    plain = Batches(ids, seq_len=8, global_batch=2, packed=True, pad_id=eot, process_index=0, process_count=1)
    x = next(plain)
    assert isinstance(x, tuple) and len(x) == 2  # unchanged without the option
    docs = Batches(
        ids,
        seq_len=8,
        global_batch=2,
        packed=True,
        pad_id=eot,
        process_index=0,
        process_count=1,
        document_masks=True,
    )
    y = next(docs)
    assert y.weights is None and np.array_equal(y.inputs, x[0]) and np.array_equal(y.targets, x[1])
    for row, seg, pos in zip(y.inputs, y.segment_ids, y.positions, strict=True):
        for t in range(1, 8):
            starts = row[t - 1] == eot
            assert seg[t] == seg[t - 1] + starts and pos[t] == (0 if starts else pos[t - 1] + 1)
        assert pos[0] == 0 and seg[0] == 0


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"Count to {i}"},
            {"role": "assistant", "content": " ".join(map(str, range(1, i + 2)))},
        ]
    }
    for i in range(30)
] + [
    {"prompt": "2+2=", "completion": "4"},
    {
        "prompt": [{"role": "user", "content": "Hi"}],
        "completion": [{"role": "assistant", "content": "Hello."}],
    },
]


def test_prepare_chat_writes_masks_and_the_corpus_batches_them(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = _jsonl(tmp_path / "a.jsonl", ROWS[:20])
    pq.write_table(pa.Table.from_pylist(ROWS[20:30]), tmp_path / "b.parquet")
    _jsonl(tmp_path / "c.jsonl", ROWS[30:])
    m = prepare(
        [str(src), str(tmp_path / "b.parquet"), str(tmp_path / "c.jsonl")],
        tmp_path / "out",
        tokenizer=str(LLAMA3),
        chat=True,
    )
    assert m["documents"] == len(ROWS) and m["chat"]["masks"][0]["tokens"] == m["tokens"]
    assert (tmp_path / "out" / "chat_template.jinja").is_file()
    corpus = load(str(tmp_path / "out"))
    assert corpus.chat and corpus.train.documents + corpus.held_out.documents == len(ROWS)
    stream = corpus.batches(seq_len=64, global_batch=2, seed=0, process_index=0, process_count=1)
    answers = set()
    for _ in range(stream.windows // 2):
        x = next(stream)
        for row, w in zip(x.targets, x.weights, strict=True):
            for run in np.split(row, np.flatnonzero(np.diff(w > 0)) + 1)[1 if w[0] == 0 else 0 :: 2]:
                answers.add(corpus.decode(run))
    held = corpus.batches(
        seq_len=512, global_batch=2, seed=0, held_out=True, process_index=0, process_count=1
    )
    assert held.packing_summary["documents"] == corpus.held_out.documents  # fewer ids than a row: padded
    assert next(held).weights.any()
    said = {" ".join(map(str, range(1, i + 2))) + "<|eot_id|>" for i in range(30)}
    trained = {a for a in answers if a[0].isdigit() and "Hello" not in a}
    assert trained and trained <= said | {"4<|eot_id|>"}


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        ([{"messages": []}], r"'X:1': 'messages' is empty, not a list .*: fix or remove the row"),
        (
            [ROWS[0], {"messages": [{"role": "robot", "content": "x"}]}],
            r"'X:2': messages\[0\] has the role 'robot'",
        ),
        (
            [{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}],
            "'X:1' opens with the assistant's message",
        ),
        ([{"completion": "c"}], "'X:1' has neither 'messages' .* nor 'prompt' and 'completion'"),
        (  # JSON's "\\ud800": a lone surrogate, which no tokenizer encodes (a UnicodeEncodeError before)
            [
                ROWS[0],
                {"prompt": [{"role": "user", "content": "a \ud800"}], "completion": ROWS[0]["messages"][-1:]},
            ],
            r"'X:2'(: prompt\[0\].content)? holds a lone UTF-16 surrogate",  # the line's reader may name it first
        ),
    ],
)
def test_bad_rows_stop_prepare_naming_file_and_row(tmp_path, rows, said):
    src = _jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(DataError, match=said.replace("X", str(src))):
        prepare([str(src)], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_a_parquet_row_whose_text_is_not_utf8_is_one_line(tmp_path):
    """Arrow writers need not check UTF-8: such a value is one line naming the row (was a
    UnicodeDecodeError, exit 1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.array([0, 1, 3], np.int32).tobytes()
    bad = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(offsets), pa.py_buffer(b"4\xff!")])
    pq.write_table(pa.table({"prompt": ["2+2=", "hi"], "completion": bad}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"'.*bad.parquet row 2' holds text that is not UTF-8 \(byte 0xff\)"):
        prepare([str(tmp_path / "bad.parquet")], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)


def test_prepare_chat_refuses_what_it_cannot_read(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", ROWS[:2])
    with pytest.raises(DataError, match="--chat applies a model's chat template: give --tokenizer"):
        prepare([str(src)], tmp_path / "o1", chat=True)
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(DataError, match="is text, but --chat reads rows"):
        prepare([str(tmp_path / "t.txt")], tmp_path / "o2", tokenizer=str(LLAMA3), chat=True)
    gpt2 = Path(__file__).parent / "corpus" / "tokenizers" / "gpt2"  # no chat template
    with pytest.raises(DataError, match=r"in.jsonl:1'.*need a chat template"):
        prepare([str(src)], tmp_path / "o3", tokenizer=str(gpt2), chat=True)
    plain = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    assert prepare([str(plain)], tmp_path / "o4", tokenizer=str(gpt2), chat=True)["chat"]["template"] is None
    with pytest.raises(DataError, match=r"holds 1 conversation.*give at least 2 rows"):
        load(str(tmp_path / "o4"))
    prepare([str(_jsonl(tmp_path / "pc2.jsonl", [{"prompt": "a", "completion": "b"}] * 3))], tmp_path / "o5",
            tokenizer=str(gpt2), chat=True)  # fmt: skip
    (tmp_path / "o5" / "documents.npy").unlink()  # a FileNotFoundError before
    with pytest.raises(DataError, match=r"documents.npy' cannot be read.*prepare .* again"):
        load(str(tmp_path / "o5"))


def test_a_mixture_of_chat_and_plain_data_is_refused(tmp_path):
    prepare([str(_jsonl(tmp_path / "c.jsonl", ROWS))], tmp_path / "chat", tokenizer=str(LLAMA3), chat=True)
    (tmp_path / "t.txt").write_text("some plain text to pretrain on. " * 200)
    prepare([str(tmp_path / "t.txt")], tmp_path / "plain", tokenizer=str(LLAMA3))
    with pytest.raises(DataError, match="mixes conversations"):  # at load, before any check asks Corpus.chat
        load(f"{tmp_path / 'chat'}:0.5,{tmp_path / 'plain'}:0.5")
    prepare(
        [str(_jsonl(tmp_path / "d.jsonl", ROWS[::-1]))], tmp_path / "chat2", tokenizer=str(LLAMA3), chat=True
    )
    mixed = load(f"{tmp_path / 'chat'}:0.5,{tmp_path / 'chat2'}:0.5")
    assert (
        mixed.chat
    )  # a mixture of conversations is conversations (--task sft trains it, pretrain refuses it)
    stream = mixed.batches(seq_len=64, global_batch=4, seed=0, process_index=0, process_count=1)
    assert stream.packing_summary["documents"] == sum(p.train.documents for p in mixed.parts)
    x = next(stream)
    mask = x.weights > 0
    assert mask.any() and np.allclose(x.weights[mask], mask.size / mask.sum()) and x.segment_ids.max() >= 1


def test_global_batch_places_a_token_batch_keeping_absent_fields():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from meshkit.data.pipeline import global_batch

    x = next(_stream(_docs(), global_batch=8))
    sharding = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("data",)), PartitionSpec("data"))
    placed = global_batch(sharding, x)
    assert isinstance(placed, TokenBatch)
    assert placed.reference is None and x.reference is None  # filled by a preference run, not the stream
    for a, b in zip(placed[:5], x[:5], strict=True):
        assert a.sharding == sharding and np.array_equal(np.asarray(a), b)
    plain = global_batch(sharding, x._replace(weights=None))
    assert plain.weights is None and np.array_equal(np.asarray(plain.positions), x.positions)


def test_the_cli_prepares_conversations_and_refuses_a_bad_row_in_one_line(tmp_path, capsys):
    from meshkit.cli import main

    good = _jsonl(tmp_path / "good.jsonl", ROWS[:3])
    assert (
        main(
            ["data", "prepare", str(good), "--chat", "--tokenizer", str(LLAMA3), "--out", str(tmp_path / "o")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "3 conversations" in out and "learnt" in out and "--task sft" in out
    bad = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"messages": [{"role": "robot", "content": "x"}]}])
    assert (
        main(
            ["data", "prepare", str(bad), "--chat", "--tokenizer", str(LLAMA3), "--out", str(tmp_path / "b")]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ") and err.count("\n") == 1 and "bad.jsonl:2': messages[0] has the role" in err
    )
