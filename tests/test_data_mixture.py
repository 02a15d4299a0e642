"""Mixtures of prepared directories, ``meshkit train --data web:0.7,code:0.3``: each global batch's rows
are dealt out by the weights (within one row at every batch), each source from its own shuffled
windows, the seed placing them; a run stopped and resumed continues with exactly the rows (and the
losses) of an uninterrupted one, also with another process count; metrics.jsonl and report.json say
what the mixture delivered, and held-out loss per source; a mixture of two tokenizers is refused."""

import json

import numpy as np
import pytest

from meshkit.cli import main
from meshkit.data import DataError, load
from meshkit.data import mixture as M
from meshkit.data import shards as S
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two prepared directories of one tokenizer (web: 20 documents, code: 10 others), and a third of
    another tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    docs = default_documents()
    for name, texts in (("web", docs[:20]), ("code", docs[20:30]), ("other", docs[30:40])):
        (root / f"{name}-text").mkdir()
        for i, t in enumerate(texts):
            (root / f"{name}-text" / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    prepare([str(root / "web-text")], root / "web", vocab_size=300)
    prepare([str(root / "code-text")], root / "code", tokenizer=str(root / "web" / S.TOKENIZER))
    prepare([str(root / "other-text")], root / "other", vocab_size=280)
    return root


def test_the_rule_deals_rows_by_the_weights_at_every_point():
    parts = M.proportions([0.7, 0.3])
    assert parts == (7, 3) and M.proportions([2, 2, 4]) == (1, 1, 2)
    seen = [0, 0]
    for m in range(1000):
        s, k = M.pick(m, parts)
        assert k == seen[s]  # each source's rows in order: its k-th row is its window k
        seen[s] += 1
        assert seen == M.counts(m + 1, parts)
        assert all(abs(c - (m + 1) * w) < 1 for c, w in zip(seen, (0.7, 0.3), strict=True))
    import grain

    for weights in ([1, 3], [2, 3, 5]):  # weights grain keeps exact (it scales the least to 100)
        tagged = [grain.MapDataset.range(10**4).map(lambda k, s=s: (s, k)) for s in range(len(weights))]
        mixed = grain.MapDataset.mix(tagged, weights)
        assert [mixed[m] for m in range(500)] == [M.pick(m, M.proportions(weights)) for m in range(500)]


def _rows(stream, n):
    return [np.asarray(next(stream)[0]) for _ in range(n)]


def test_batches_draw_each_source_from_its_own_windows_by_the_weights(sources):
    data = load(f"{sources / 'web'}:0.7,{sources / 'code'}:0.3")
    assert [p.name for p in data.parts] == ["web", "code"] and [p.weight for p in data.parts] == [0.7, 0.3]
    assert data.num_tokens == sum(len(p.train) + len(p.held_out) for p in data.parts)
    stream = data.batches(seq_len=32, global_batch=10, seed=5, process_index=0, process_count=1)
    batches = _rows(stream, 20)
    assert stream.delivered(20) == {
        "mix/web/rows": 7, "mix/web/rows_total": 140, "mix/web/tokens": 224, "mix/web/tokens_total": 4480,
        "mix/code/rows": 3, "mix/code/rows_total": 60, "mix/code/tokens": 96, "mix/code/tokens_total": 1920,
    }  # fmt: skip
    got = sorted(r.tobytes() for b in batches for r in b)
    want = sorted(
        stream.sources[s].window(k)[:-1].tobytes() for s, n in enumerate(stream.rows(20)) for k in range(n)
    )
    assert got == want  # every row a window of one source, each source's first windows, each once
    webs = {stream.sources[0].window(k)[:-1].tobytes() for k in range(7)}
    places = [i for i, r in enumerate(batches[0]) if r.tobytes() in webs]
    other = data.batches(seq_len=32, global_batch=10, seed=6, process_index=0, process_count=1)
    assert len(places) == 7 and other.rows(20) == stream.rows(20)
    assert not np.array_equal(_rows(other, 1)[0], batches[0])  # the seed orders the sources' windows...
    assert places != list(range(7))  # ...and places them in the batch


def test_resume_is_exact_with_another_process_count_and_checks_the_sources(sources):
    spec = f"{sources / 'web'}:0.7,{sources / 'code'}:0.3"
    data = load(spec)
    kw = dict(seq_len=32, global_batch=8, seed=3)
    straight = _rows(data.batches(**kw, process_index=0, process_count=1, threads=2), 6)
    first = data.batches(**kw, process_index=0, process_count=1, threads=2)
    _rows(first, 2)
    state = json.loads(json.dumps(first.state))
    first.close()
    assert state["batch"] == 2 and [s["rows"] for s in state["sources"]] == [12, 4]
    parts = []
    for p in range(2):
        resumed = load(spec).batches(**kw, process_index=p, process_count=2, threads=2)
        resumed.restore(state)
        parts.append(_rows(resumed, 4))
        resumed.close()
    for b in range(4):
        assert np.array_equal(np.concatenate([parts[0][b], parts[1][b]]), straight[2 + b])
    fresh = data.batches(**kw, process_index=0, process_count=1)
    bad = json.loads(json.dumps(state))
    bad["sources"][0]["rows"] += 1
    with pytest.raises(DataError, match=r"rows per source \[13, 4\] are not those its batch count 2 gives"):
        fresh.restore(bad)
    with pytest.raises(DataError, match="not this mixture of"):
        load(f"{sources / 'web'}:0.5,{sources / 'code'}:0.5").batches(**kw).restore(state)
    one = load(str(sources / "web")).batches(**kw, process_index=0, process_count=1)
    with pytest.raises(DataError, match="data state was saved with"):
        one.restore(state)
    with pytest.raises(DataError, match="saved with one source"):
        fresh.restore(one.state)


def _one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


def test_bad_mixtures_are_one_line(sources, tmp_path, capsys):
    web, code, other = (str(sources / n) for n in ("web", "code", "other"))
    (tmp_path / "t.txt").write_text("some text")
    run = ["train", "--preset", "tiny", "--run-dir", str(tmp_path / "run"), "--data"]
    cases = {
        f"{web}:0.5,{other}:0.5": f"'{other}' was prepared with another tokenizer than '{web}'",
        f"{web}:0.5,{tmp_path / 't.txt'}:0.5": "is not a directory made by meshkit data prepare",
        f"{web}:0.5,{code}": f"source '{code}' has no weight",
        f"{web}:0.5,{code}:-1": f"the weight of '{code}' is -1",
        f"{web}:0.5,{web}:0.5": "names a source twice",
        f"{web}:1,{code}:1e-9": f"'{code}' has the weight 1e-09, a share of 1e-09 of the mixture, below its resolution",
    }
    for spec, match in cases.items():
        _one_line_exit_2(capsys, [*run, spec], match)
    assert not (tmp_path / "run").exists()
    huge = load(f"{web}:1e308,{code}:1e308")  # their sum overflows: still an even mixture
    assert [p.weight for p in huge.parts] == [0.5, 0.5]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_run_stopped_and_resumed_trains_as_an_uninterrupted_one(sources, tmp_path, capsys):
    spec = f"{sources / 'web'}:0.7,{sources / 'code'}:0.3"
    run = ["train", "--preset", "tiny", "--steps", "6", "--warmup", "0", "--eval-every", "3", "--checkpoint-every",
           "3", "--sample-chars", "0", "--batch-size", "16", "--data", spec]  # fmt: skip
    assert main([*run, "--run-dir", str(tmp_path / "straight")]) == 0
    out = capsys.readouterr().out
    assert main([*run, "--run-dir", str(tmp_path / "resumed"), "--stop-after", "3"]) == 0
    assert main(["train", "--resume", "--run-dir", str(tmp_path / "resumed")]) == 0
    rows = {n: _metrics(tmp_path / n) for n in ("straight", "resumed")}
    losses = {n: {r["step"]: r["loss"] for r in rs if "loss" in r} for n, rs in rows.items()}
    assert sorted(losses["straight"]) == list(range(1, 7))
    assert losses["resumed"] == losses["straight"]  # bitwise: the same rows, the same steps
    steps = [r for r in rows["straight"] if "loss" in r]
    assert [r["mix/web/rows"] for r in steps] == [
        12,
        11,
        11,
        11,
        11,
        12,
    ]  # 0.7 of 16: within a row of 11.2 x step
    assert [r["mix/code/rows_total"] for r in steps] == [4, 9, 14, 19, 24, 28]
    assert [r["mix/web/tokens"] for r in steps] == [32 * r["mix/web/rows"] for r in steps]
    assert [{k: v for k, v in r.items() if k.startswith("mix/")} for r in rows["resumed"] if "loss" in r] == [
        {k: v for k, v in r.items() if k.startswith("mix/")} for r in steps
    ]
    assert [r["mix/web/rows_total"] + r["mix/code/rows_total"] for r in steps] == [
        16 * s for s in range(1, 7)
    ]
    evals = [r for r in rows["straight"] if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for e in evals:
        assert e["eval_loss"] == pytest.approx(
            0.7 * e["eval_loss/web"] + 0.3 * e["eval_loss/code"], rel=1e-12
        )
        assert e["eval_loss/web"] != e["eval_loss/code"] and "eval_bpb/code" in e
    report = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert [(m["name"], m["rows"], m["weight"]) for m in report["mixture"]] == [
        ("web", 68, 0.7),
        ("code", 28, 0.3),
    ]
    assert report["mixture"][1]["eval_loss"] == evals[-1]["eval_loss/code"]
    assert "data: web" in out and "70.8% of rows (weight 70.0%)" in out
