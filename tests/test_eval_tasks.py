"""``--eval-tasks``: multiple-choice log-likelihood tasks scored as lm-evaluation-harness scores them
(``meshkit.train.evals``): the scores against NumPy float64, acc and acc_norm on a case whose answer is
known, a sharded plan against one device, one compile for many questions, bad rows in one line, and the
option through a tiny run; marked reference: the split against the harness's rule on transformers' tokenizers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from conftest import REFERENCES
from meshkit.data.tokenizer import load_tokenizer
from meshkit.models import llama, registry
from meshkit.spec import ParallelSpec
from meshkit.train import Trainer, evals
from meshkit.train import config as C
from meshkit.train.evals import Question, Task, TaskError

SEQ = 16
ALPHABET = " abcdefghijklmnopqrstuvwxyz.?:"


def encode(text: str) -> np.ndarray:
    """A character tokenizer of 30 ids under the small Llama's vocabulary of 64."""
    return np.asarray([ALPHABET.index(c) for c in text], np.int32)


def _task(name: str = "toy") -> Task:
    """Questions of 2 to 4 choices; one context longer than SEQ (left-truncated), one with a trailing space."""
    rows = [
        ("the sky is", ["blue", "green", "loud"], 0),
        ("a cat says ", ["meow", "moo"], 0),
        ("question: what comes after one? answer:", ["two", "three", "eleven", "zero"], 0),
        ("b", ["a", "bbbbbbbb", "c"], 2),
        ("xyz", ["z", "zz"], 1),
    ]
    return Task(name=name, questions=tuple(Question(context=c, choices=tuple(ch), gold=g, where=f"{name}:{i}")
                                           for i, (c, ch, g) in enumerate(rows, 1)))  # fmt: skip


def _small(dtype: str = "float64", scan_layers: bool = False):
    cfg = registry.family("llama").small(layers=2, heads=4, experts=0, scan_layers=scan_layers)
    cfg = dataclasses.replace(cfg, dtype=dtype)
    return cfg, llama.init(jax.random.key(0), cfg)


def _one_device() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


def _eval(tasks, cfg, sharding, rows=4) -> evals.TaskEval:
    return evals.TaskEval(tasks, evals.requests(tasks, encode, SEQ), rows=rows, sharding=sharding,
                          apply=lambda p, t: llama.apply(p, t, cfg))  # fmt: skip


def _reference(task: Task, cfg, params) -> list[np.ndarray]:
    """Each choice's log-likelihood: the harness's split and left truncation written out for characters,
    the sequences padded with another token than the eval pads with (a padded position counted would
    differ), the model run once on them all, log-softmax and sums in NumPy float64."""
    seqs = []
    for q in task.questions:
        for choice in q.choices:
            context = q.context.rstrip()
            continuation = q.context[len(context) :] + " " + choice
            seqs.append((encode(context + continuation)[-(SEQ + 1) :], len(continuation)))
    filler = np.full((len(seqs), SEQ), len(ALPHABET) - 1, np.int32)
    for row, (ids, _) in zip(filler, seqs, strict=True):
        row[: len(ids) - 1] = ids[:-1]
    logits = np.asarray(llama.apply(params, filler, cfg), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    lls = [sum(logp[i, t, ids[t + 1]] for t in range(len(ids) - 1 - n, len(ids) - 1))
           for i, (ids, n) in enumerate(seqs)]  # fmt: skip
    cuts = np.cumsum([len(q.choices) for q in task.questions])[:-1]
    return np.split(np.array(lls), cuts)


def test_scores_equal_numpy_float64_and_compile_once():
    task = _task()
    with jax.enable_x64(True):
        cfg, params = _small()
        ev = _eval((task,), cfg, _one_device())
        got = ev.by_question(ev.scores(params))[0]
        ev.scores(params)
        want = _reference(task, cfg, params)
    assert len(ev.requests.tokens) == 14 and ev.score_rows._cache_size() == 1  # 4 batches of 4, one compile
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=0)


def test_a_lora_run_scores_its_merged_weights(tmp_path):
    """``build``'s ``params_of`` (a LoRA run's merge, as job.prepare passes it) is applied inside the
    scoring: the scores are the merged model's, not the base's (adapters made non-zero)."""
    from meshkit.models import lora

    task = _task()
    rows = [{"query": q.context, "choices": list(q.choices), "gold": q.gold} for q in task.questions]
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    adapters = lora.LoraConfig(rank=2, alpha=4.0)
    with jax.enable_x64(True):
        cfg, base = _small()
        params = lora.add(jax.random.key(1), base, adapters)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x, params
        )
        ev = evals.build(str(tmp_path / "toy.jsonl"), encode, registry.family_of(cfg), cfg, seq_len=SEQ, rows=4, sharding=_one_device(),
                         params_of=lambda p: lora.merge(p, adapters))  # fmt: skip
        got = ev.by_question(ev.scores(params))[0]
        want, plain = _reference(task, cfg, lora.merge(params, adapters)), _reference(task, cfg, base)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=0)
    assert max(np.max(np.abs(w - b)) for w, b in zip(want, plain, strict=True)) > 1e-3


def test_split_pair_moves_trailing_space_and_splits_the_whole_encoding():
    # a tokenizer that merges a space with the next word: the split follows the whole encoding
    words = {"a cat": [1], "a": [2], "cat": [3], " ": [4], "says": [5], " meow": [6]}

    def merging(text):
        out = []
        for piece in text.replace(" meow", "|meow").split("|"):
            out += [6] if piece == "meow" else words.get(piece, [9] * len(piece))
        return out

    assert evals.split_pair(merging, "a ", "meow") == ([2], [6])  # "a" + " meow"
    assert evals.split_pair(encode, "ab  ", " c") == (list(encode("ab")), list(encode("   c")))


def test_acc_and_acc_norm_count_as_the_harness():
    q = Question(context="x", choices=("a", "bbbb"), gold=1, where="t:1")
    task = Task(name="t", questions=(q, dataclasses.replace(q, gold=0)))
    # -2 per 1 char beats -4 raw, loses per char (-2 < -1): acc picks choice 0, acc_norm choice 1
    assert evals.accuracy(task, [np.array([-2.0, -4.0])] * 2) == {"acc/t": 0.5, "acc_norm/t": 0.5}
    assert evals.accuracy(task, [np.array([-1.0, -1.0])] * 2) == {
        "acc/t": 0.5,
        "acc_norm/t": 0.5,
    }  # tie: first


def test_a_model_made_to_prefer_one_token_answers_where_it_is_gold():
    """Zero blocks and an embedding of ones make every position's hidden state the same; the head's column
    for 'q' alone is large, so the choice 'q' wins every question: acc is the share where 'q' is gold."""
    cfg, params = _small("float32")
    params = jax.tree.map(np.zeros_like, params)
    params["tok_embed"] = np.ones_like(params["tok_embed"])
    params["norm_f"] = jax.tree.map(np.ones_like, params["norm_f"])
    params["unembed"] = np.zeros_like(params["unembed"])
    params["unembed"][:, ALPHABET.index("q")] = 10.0
    rows = [("a b", ["q", "r"], 0), ("c d", ["r", "q", "s"], 1), ("e", ["s", "q"], 1), ("f", ["q", "r"], 1)]
    task = Task(name="prefer", questions=tuple(Question(context=c, choices=tuple(ch), gold=g, where="x")
                                               for c, ch, g in rows))  # fmt: skip
    assert _eval((task,), cfg, _one_device())(params) == {"acc/prefer": 0.75, "acc_norm/prefer": 0.75}


# Tiers: fsdp+tp (parameters split over data and model) and dp+pp are core; fsdp (split over data alone,
# the batch over data as fsdp+tp's) sweeps.
@pytest.mark.parametrize(
    ("plan", "mesh"),
    [
        pytest.param("fsdp", "data=8", marks=pytest.mark.sweep),
        ("fsdp+tp", "data=4,model=2"),
        ("dp+pp", "stage=2,data=4"),
    ],
)
def test_scores_under_a_sharded_plan_equal_one_device(plan, mesh):
    """The parameters where the plan puts them (a pipeline's: the blocks stacked, split over the stages)."""
    task, pipeline = _task(), "pp" in plan
    with jax.enable_x64(True):
        cfg, params = _small(scan_layers=pipeline)
        one = _eval((task,), cfg, _one_device(), rows=8).scores(params)
        loss = llama.stages(cfg) if pipeline else llama.make_loss(cfg)
        t = Trainer(loss, params, optax.sgd(0.1), spec=ParallelSpec(plan=plan, mesh=mesh),
                    tokens_per_example=SEQ, units=llama.units(cfg), logical_axes=llama.logical_axes(params))  # fmt: skip
        sharded = _eval((task,), cfg, t.shardings.batch, rows=8)
        assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
                   for leaf in jax.tree.leaves(t.params))  # fmt: skip
        np.testing.assert_allclose(sharded.scores(t.params), one, rtol=1e-10, atol=0)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not an object"),
        ('{"choices": ["a", "b"], "gold": 0}', '"query"'),
        ('{"query": "q", "choices": ["a"], "gold": 0}', "at least two"),
        ('{"query": "q", "choices": ["a", "b"], "gold": 2}', "0 to 1; got 2"),
        ('{"query": "q", "choices": ["a", "b"], "label": true}', "0 to 1; got true"),
        (
            '{"query": "q \\udc00", "choices": ["a", "b"], "gold": 0}',
            "query holds a lone UTF-16 surrogate (\\udc00 at character 2)",
        ),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else v,
)
def test_a_bad_row_is_one_line_naming_file_line_and_fix(tmp_path, line, says):
    path = tmp_path / "t.jsonl"
    path.write_text('{"query": "fine", "choices": ["a", "b"], "label": "1"}\n\n' + line + "\n")
    with pytest.raises(TaskError) as e:
        evals.read_tasks(str(path))
    message = str(e.value)
    assert message.startswith(f"{path}:3: ") and says in message and "\n" not in message


def test_rows_the_run_cannot_score_name_the_row(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"query": "ok", "choices": ["a", "B"], "gold": 0}\n')
    with pytest.raises(TaskError, match=rf"^{path}:1: .*'B'"):
        evals.requests(evals.read_tasks(str(path)), _corpus_encode, SEQ)
    path.write_text(
        '{"query": "ok", "choices": ["a", "' + "b" * SEQ + '"], "gold": 0}\n'
    )  # 17 tokens with " "
    with pytest.raises(TaskError, match=rf"^{path}:1: choice 1 is 17 token\(s\).*--seq-len 16"):
        evals.requests(evals.read_tasks(str(path)), encode, SEQ)
    with pytest.raises(TaskError, match=r"no file 'nope\.jsonl'.*python_docs"):
        evals.read_tasks("nope.jsonl")


def _corpus_encode(text):
    from meshkit.data import DataError

    if "B" in text:
        raise DataError(
            "1 character(s) outside the run's vocabulary (first 'B'): use characters of its training data"
        )
    return encode(text)


def test_the_shipped_task_reads_and_fits_the_default_corpus():
    from meshkit.data import load

    (task,) = evals.read_tasks("python_docs")
    assert task.name == "python_docs" and 20 <= len(task.questions) <= 50
    r = evals.requests((task,), load(None).encode, 128)
    assert r.mask.sum(1).min() >= 2  # every choice: the delimiter and at least one character


def test_a_run_reports_acc_per_task_at_each_eval_step(tmp_path):
    from rich.console import Console

    from meshkit.train.loop import run

    cfg = C.tiny().replace(steps=4, eval_every=2, checkpoint_every=4, eval_tasks="python_docs", sample_chars=0,
                           run_dir=str(tmp_path / "run"))  # fmt: skip
    console = Console(record=True, width=200)
    assert run(cfg, console) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals_at = [r["step"] for r in rows if "acc/python_docs" in r]
    assert evals_at == [2, 4] and all(
        0 <= r["acc_norm/python_docs"] <= 1 for r in rows if "acc/python_docs" in r
    )
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["tasks"]["python_docs"]["acc"] == rows[-1]["acc/python_docs"]
    text = console.export_text()
    assert "step 2 tasks: python_docs acc" in text and "task: python_docs" in text


_HARNESS = r"""
import json, sys
from transformers import AutoTokenizer

def encode_pair(tok, context, continuation):  # lm_eval/api/model.py _encode_pair, causal (4e7e0d47f33b)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole_enc = tok.encode(context + continuation)  # HFLM.tok_encode: the tokenizer's own special tokens
    context_enc = tok.encode(context)
    return context_enc, whole_enc[len(context_enc):]

pairs = json.loads(open(sys.argv[1]).read())
print(json.dumps({d: [encode_pair(AutoTokenizer.from_pretrained(d), c, x) for c, x in pairs] for d in sys.argv[2:]}))
"""


# Tiers: sweeps; meshkit's split of (context, " " + choice) is core in
# test_split_pair_moves_trailing_space_and_splits_the_whole_encoding, the corpus tokenizers' ids as the
# tokenizers library's (BOS included) in test_data_hf_tokenizers.py's
# test_real_tokenizers_give_the_tokenizers_librarys_ids; transformers' AutoTokenizer on a tokenizer
# directory in test_chat_template.py's test_ids_equal_transformers_apply_chat_template[transformers5].
@pytest.mark.sweep
@pytest.mark.reference
def test_the_split_is_the_harness_split_with_transformers_tokenizers(tmp_path, reference_python):
    """The tokenizers of tests/corpus (with a BOS: openllama under transformers 4.x, which meshkit follows;
    without: gpt2, pythia) split each (context, " " + choice) as the harness's ``_encode_pair`` does on
    transformers' AutoTokenizer."""
    here = Path(__file__).parent / "corpus" / "tokenizers"
    five = Path(reference_python).parents[1].name == REFERENCES["transformers5"]
    dirs = [here / n for n in ("gpt2", "pythia", *(() if five else ("openllama",)))]
    (task,) = evals.read_tasks("python_docs")
    pairs = [(q.context, " " + c) for q in task.questions[:10] for c in q.choices]
    pairs += [("Question: 2 + 2 =  ", " 4"), ("naïve café\n", " déjà vu"), ("x", " 12345")]
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    done = subprocess.run([reference_python, "-c", _HARNESS, str(tmp_path / "pairs.json"), *map(str, dirs)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(done.stdout.splitlines()[-1])
    for d in dirs:
        tok = load_tokenizer(d)

        def encode(
            text, tok=tok
        ):  # as Corpus.encode: the document's prefix (a BOS where there is one), then the text
            return np.concatenate([np.asarray(tok.prefix, np.int32), tok.encode(text)])

        got = [list(evals.split_pair(encode, c, x)) for c, x in pairs]
        assert got == ref[str(d)], d
