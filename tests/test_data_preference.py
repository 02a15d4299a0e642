"""Preference pairs for DPO: ``meshkit data prepare --chat`` reads TRL's preference rows (prompt, chosen and
rejected as strings or messages, or two conversations sharing their prompt) into two documents a row, the
chosen one then the rejected one, each exactly the prompt/completion row of its completion; a bad row is
one line naming it and leaves nothing written; a loaded corpus knows it holds pairs and never splits one;
``PairRows`` lays out a pair per row (segments 1 and 2, positions restarting, the target mask as packed
rows'), cutting a pair longer than the row by its rule; the batch stream's weights are the 0/1 mask."""

import json
from pathlib import Path

import numpy as np
import pytest

from meshkit.data.chat import Encoder
from meshkit.data.chat_template import load_template
from meshkit.data.corpus import load
from meshkit.data.packing import ChatSource, PairRows, pair_cut
from meshkit.data.pipeline import Batches
from meshkit.data.prepare import prepare
from meshkit.data.prepare_chat import summary
from meshkit.data.source import ArraySource, DataError
from meshkit.data.tokenizer import load_tokenizer

LLAMA3 = Path(__file__).parent / "corpus" / "chat_templates" / "llama3"
USER, HELLO, AWAY = (
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "assistant", "content": "Go away."},
)
STRINGS = [
    {"prompt": f"What is {i} + {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}."} for i in range(5)
]
EXPLICIT = {"prompt": [USER], "chosen": [HELLO], "rejected": [AWAY]}
IMPLICIT = {"chosen": [USER, HELLO], "rejected": [USER, AWAY]}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _documents(out: Path) -> list[tuple[list[int], list[int]]]:
    """Every document of a prepared directory, in order: its ids and mask."""
    corpus = load(str(out))
    return [
        (src.tokens.read(s, e).tolist(), src.masks.read(s, e).tolist())
        for src in (corpus.train, corpus.held_out)
        for s, e in zip(src.starts.tolist(), src.ends.tolist(), strict=True)
    ]


def _encoder() -> Encoder:
    return Encoder(load_tokenizer(LLAMA3), load_template(LLAMA3))


def test_string_rows_become_the_chosen_then_the_rejected_prompt_completion_document(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(STRINGS[3:]), tmp_path / "b.parquet")  # chosen/rejected columns read
    inputs = [str(_jsonl(tmp_path / "a.jsonl", STRINGS[:3])), str(tmp_path / "b.parquet")]
    m = prepare(inputs, tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert m["documents"] == 2 * len(STRINGS) and m["chat"]["preference"] == {"pairs": len(STRINGS)}
    said = summary(m)
    assert f"; {len(STRINGS)} preference pairs (chosen, rejected" in said and "of them learnt" in said
    docs, enc, tok = _documents(tmp_path / "out"), _encoder(), load_tokenizer(LLAMA3)
    for k, row in enumerate(STRINGS):
        for side, (ids, mask) in zip(("chosen", "rejected"), docs[2 * k : 2 * k + 2], strict=True):
            want_ids, want_mask = enc.encode_row({"prompt": row["prompt"], "completion": row[side]}, "x")
            assert ids == want_ids.tolist() and mask == want_mask.tolist()
            # the tokenizer's framing: its BOS first, its end of text last; the completion and it learnt
            assert ids[: len(tok.prefix)] == list(tok.prefix) and ids[-len(tok.suffix) :] == list(tok.suffix)
            prompt = len(tok.prefix) + len(tok.encode(row["prompt"]))
            assert not any(mask[:prompt]) and all(mask[prompt:])
    assert sum(sum(mk) for _, mk in docs) == m["chat"]["learnt_tokens"]
    plain = prepare([str(_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}] * 2))],
                    tmp_path / "plain", tokenizer=str(LLAMA3), chat=True)  # fmt: skip
    assert "preference" not in plain["chat"] and "preference" not in summary(plain)
    assert not load(str(tmp_path / "plain")).preference and load(str(tmp_path / "out")).preference


def test_conversational_and_implicit_prompt_rows_are_their_prompt_completion_rows(tmp_path):
    system = {"role": "system", "content": "Be kind."}
    longer = {"chosen": [system, USER, HELLO, USER, HELLO], "rejected": [system, USER, HELLO, USER, AWAY]}
    rows = [EXPLICIT, IMPLICIT, longer]
    prepare([str(_jsonl(tmp_path / "c.jsonl", rows))], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    docs, enc = _documents(tmp_path / "out"), _encoder()
    assert docs[0:2] == docs[2:4]  # the implicit prompt is the first message both share
    prompt = [system, USER, HELLO, USER]  # TRL's maybe_extract_prompt: the longest common prefix of messages
    for k, (p, c, r) in enumerate(
        [([USER], [HELLO], [AWAY]), ([USER], [HELLO], [AWAY]), (prompt, [HELLO], [AWAY])]
    ):
        for (ids, mask), completion in zip(docs[2 * k : 2 * k + 2], (c, r), strict=True):
            want_ids, want_mask = enc.encode_row({"prompt": p, "completion": completion}, "x")
            assert ids == want_ids.tolist() and mask == want_mask.tolist()
            learnt = enc.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
            assert learnt == completion[0]["content"] + "<|eot_id|>"  # only the completion is learnt


def _pairs(lengths: list[tuple[int, int]], seed: int = 0) -> ChatSource:
    """Pairs of the given lengths: ids that name their document (doc d's: 1000 * (d + 1) + position), a
    random mask."""
    flat = np.array(lengths).reshape(-1)
    ends = np.cumsum(flat)
    ids = np.concatenate([1000 * (d + 1) + np.arange(n) for d, n in enumerate(flat)]).astype(np.int32)
    mask = (np.random.default_rng(seed).random(len(ids)) < 0.5).astype(np.int32)
    return ChatSource(ArraySource(ids), ArraySource(mask), ends - flat, ends, pairs=True)


def test_a_row_holds_one_pair_laid_out_as_computed_by_hand():
    seq, pad = 15, 7  # rows of 16 ids: half a row is 8
    lengths = [(3, 4), (20, 3), (12, 12), (5, 11), (9, 9), (1, 2)]
    src = _pairs(lengths)
    rows = PairRows(src, seq, pad)
    kept = [
        (3, 4),
        (13, 3),
        (8, 8),
        (5, 11),
        (8, 8),
        (1, 2),
    ]  # the rule: shorter whole within half, else halves
    assert rows.lengths.tolist() == [n for pair in kept for n in pair]
    assert rows.summary == {
        "pairs": 6,
        "documents": 12,
        "rows": 6,
        "truncated": 3,
        "fill": round(sum(map(sum, kept)) / 96, 4),
    }
    mask = src.masks.read(0, len(src.masks))
    for i, (c, r) in enumerate(kept):
        ids = np.full(seq + 1, pad)
        ids[:c] = 1000 * (2 * i + 1) + np.arange(c)
        ids[c : c + r] = 1000 * (2 * i + 2) + np.arange(r)
        seg = np.array([1] * c + [2] * r + [0] * (seq + 1 - c - r))
        pos = np.concatenate([np.arange(c), np.arange(r), np.zeros(seq + 1 - c - r, int)])
        learn = np.zeros(seq + 1, int)  # each id's own mask, from the source
        learn[:c] = mask[src.starts[2 * i] : src.starts[2 * i] + c]
        learn[c : c + r] = mask[src.starts[2 * i + 1] : src.starts[2 * i + 1] + r]
        want = [int(learn[t + 1] and seg[t + 1] == seg[t] and seg[t + 1] > 0) for t in range(seq)]
        assert rows.tokens(i).tolist() == ids.tolist()
        assert [a.tolist() for a in rows.layout(i)] == [seg.tolist(), pos.tolist()]
        assert rows.target_mask(i).tolist() == want
    assert want[0] == 0 and rows.target_mask(2)[7] == 0  # a document's first id is never a target
    # an odd row: the chosen side takes the extra id; the layout is a pure function of data and seq_len
    assert [int(a[0]) for a in pair_cut(np.array([30]), np.array([30]), 17)] == [9, 8]
    again = PairRows(_pairs(lengths), seq, pad)
    assert all(np.array_equal(again.layout(i)[0], rows.layout(i)[0]) for i in range(6))


def test_held_out_pairs_are_whole_pairs_at_the_end(tmp_path):
    src = _pairs([(5 + i % 4, 3 + i % 5) for i in range(9)])
    for held in (0, 1, 8, 17, 40, 10**6):
        train, out = src.split(held)
        assert train.pairs and out.pairs and train.documents % 2 == 0 and out.documents % 2 == 0
        assert train.documents >= 2 and (held == 0 or out.documents >= 2)
        assert train.ends[-1] == (out.starts[0] if out.documents else src.ends[-1])  # the held-out tail
    rows = [{**r, "chosen": r["chosen"] * (i + 1)} for i, r in enumerate(STRINGS * 2)]
    prepare([str(_jsonl(tmp_path / "p.jsonl", rows))], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    corpus = load(str(tmp_path / "out"))
    assert corpus.preference and corpus.chat
    assert corpus.train.documents % 2 == 0 and corpus.held_out.documents >= 2
    assert corpus.train.documents + corpus.held_out.documents == 2 * len(rows)


BAD = [
    (
        "chosen-alone",
        [{"prompt": "p", "chosen": "a"}],
        r"'X:1' has 'chosen' but no 'rejected': a preference row needs both; fix or remove the row",
    ),
    (
        "rejected-alone",
        [STRINGS[0], {"prompt": "p", "chosen": None, "rejected": "b"}],
        r"'X:2' has 'rejected' but no 'chosen'",
    ),
    (
        "same-strings",
        [{"prompt": "p", "chosen": "a", "rejected": "a"}],
        r"'X:1': 'chosen' and 'rejected' are the same: the pair teaches nothing; fix or remove the row",
    ),
    (
        "same-messages",
        [EXPLICIT, {"prompt": [USER], "chosen": [HELLO], "rejected": [dict(HELLO)]}],
        r"'X:2': 'chosen' and 'rejected' are the same: the pair teaches nothing",
    ),
    (
        "same-implicit",
        [{"chosen": [USER, HELLO], "rejected": [USER, HELLO]}],
        r"'X:1': 'chosen' and 'rejected' are the same",
    ),
    (
        "same-ids",
        [{"prompt": [USER], "chosen": [HELLO], "rejected": [{**HELLO, "note": "unrendered"}]}],
        r"'X:1': 'chosen' and 'rejected' encode to the same ids \(the template renders them alike\): the pair teaches nothing",
    ),
    (
        "empty-chosen",
        [{"prompt": "p", "chosen": "", "rejected": "b"}],
        r"'X:1': 'chosen' is empty: nothing to learn; fix or remove the row",
    ),
    (
        "empty-rejected",
        [{"prompt": [USER], "chosen": [HELLO], "rejected": []}],
        r"'X:1': 'rejected' is empty, not a list of \{role, content\} messages: fix or remove the row",
    ),
    (
        "implicit-strings",
        [{"chosen": "a", "rejected": "b"}],
        r"'X:1' has no 'prompt', and 'chosen' and 'rejected' are not both lists of messages .*: give the row its 'prompt'",
    ),
    (
        "implicit-unshared",
        [{"chosen": [USER, HELLO], "rejected": [{"role": "user", "content": "Yo"}, AWAY]}],
        r"'X:1' has no 'prompt', .* open with different messages .*: give the row its 'prompt'",
    ),
    (
        "implicit-all-prompt",
        [{"chosen": [USER, HELLO], "rejected": [USER, HELLO, USER, AWAY]}],
        r"'X:1': 'chosen' ends where .*: nothing to learn; fix or remove the row",
    ),
    (
        "rejected-no-answer",
        [{"prompt": [USER], "chosen": [HELLO], "rejected": [USER]}],
        r"'X:1' has no assistant message to learn: add one, or remove the row",
    ),
    (
        "beside-messages",
        [{"messages": [USER, HELLO], "chosen": "a", "rejected": "b"}],
        r"'X:1' has 'messages' beside 'chosen' and 'rejected': give a preference pair or a conversation, not both",
    ),
    (
        "then-a-conversation",
        [STRINGS[0], STRINGS[1], {"messages": [USER, HELLO]}],
        r"'X:3' is not a preference pair \('chosen' and 'rejected'\), and the rows from 'X:1' on are: prepare preference pairs and other rows apart",
    ),
    (
        "after-a-conversation",
        [{"prompt": "p", "completion": "c"}, STRINGS[0]],
        r"'X:2' is a preference pair \('chosen' and 'rejected'\), and the rows from 'X:1' on are not: prepare",
    ),
]


@pytest.mark.parametrize(("rows", "said"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_preference_row_is_one_line_naming_it_and_nothing_is_written(tmp_path, rows, said):
    src = _jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(DataError, match=said.replace("X", str(src))) as e:
        prepare([str(src)], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_the_inputs_hold_one_kind_of_row_across_files(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", STRINGS)
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(DataError, match=rf"'{b}:1' is not a preference pair .* from '{a}:1' on are"):
        prepare([str(a), str(b)], tmp_path / "out", tokenizer=str(LLAMA3), chat=True)
    assert not (tmp_path / "out").exists()


def test_batches_of_pairs_weigh_each_target_0_or_1_and_resume_only_on_pairs():
    src = _pairs([(3 + i % 7, 2 + i % 5) for i in range(10)])
    kw = {"seq_len": 12, "global_batch": 4, "seed": 5, "pad_id": 0, "process_index": 0, "process_count": 1}
    b = Batches(src, **kw)
    assert b.chat and b.preference and b.windows == 10 and b.packing_summary["pairs"] == 10
    halves = [Batches(src, **{**kw, "process_index": p, "process_count": 2}) for p in range(2)]
    for n in range(3):
        x = next(b)
        assert x.weights.dtype == np.float32 and set(np.unique(x.weights)) <= {0.0, 1.0} and x.weights.any()
        rows = [int(b._order[i]) for i in range(4 * n, 4 * n + 4)]  # shuffled by pair with the seed
        assert x.weights.tolist() == [b.packing.target_mask(r).tolist() for r in rows]
        assert x.segment_ids.tolist() == [b.packing.layout(r)[0][:-1].tolist() for r in rows]
        joined = [next(h) for h in halves]  # each process's rows: the same, unscaled
        assert np.array_equal(np.concatenate([j.weights for j in joined]), x.weights)
    state = json.loads(json.dumps(b.state))
    assert state["preference"] is True and state["chat"] is True
    after = Batches(src, **kw)
    after.restore(state)
    assert all(np.array_equal(u, v) for u, v in zip(next(after)[:5], next(b)[:5], strict=True))
    with pytest.raises(
        DataError, match=r"data state was saved with preference=None but this run has preference=True"
    ):
        Batches(src, **kw).restore({k: v for k, v in state.items() if k != "preference"})
    plain = ChatSource(src.tokens, src.masks, src.starts, src.ends)
    with pytest.raises(DataError, match="preference=True but this run has preference=None"):
        Batches(plain, **kw).restore(state)


def test_a_mixture_of_preference_data_is_refused_and_the_cli_names_dpo(tmp_path, capsys):
    from meshkit.cli import main

    a = _jsonl(tmp_path / "a.jsonl", STRINGS)
    assert (
        main(["data", "prepare", str(a), "--chat", "--tokenizer", str(LLAMA3), "--out", str(tmp_path / "p")])
        == 0
    )
    out = capsys.readouterr().out
    assert "10 documents" in out and "5 preference pairs" in out and "--task dpo" in out
    sft = _jsonl(
        tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "q", "completion": "d"}]
    )
    prepare([str(sft)], tmp_path / "s", tokenizer=str(LLAMA3), chat=True)
    with pytest.raises(
        DataError, match=r"--data: 'p' holds preference pairs, which a mixture does not draw from"
    ):
        load(f"{tmp_path / 'p'}:0.5,{tmp_path / 's'}:0.5")
