"""A model's own Hugging Face tokenizer in ``meshkit data prepare`` (issue 36): its end-of-text and
BOS tokens read from the tokenizer_config.json / special_tokens_map.json beside it (or ``--eos-token`` /
``--bos-token``), a BOS before each document exactly where transformers puts one, and those ids in the
manifest, the run's corpus and its export. Real tokenizers published by others (trimmed:
tests/corpus/tokenizers/README.md) give the ``tokenizers`` library's ids for every document of the
embedded corpus, and (``-m reference``) transformers' ``AutoTokenizer``'s; fixtures shaped like Llama
3's, Mistral's, Gemma's and Qwen2's configs name their tokens as those do. Bad input is one line, exit
2, nothing written."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from _limits import limit
from conftest import REFERENCES
from meshkit.cli import main
from meshkit.data import DataError, load
from meshkit.data import shards as S
from meshkit.data.prepare import prepare
from meshkit.data.text import default_documents
from meshkit.data.tokenizer import train_bpe
from meshkit.train import config as C
from meshkit.train.outputs import special_tokens

HERE = Path(__file__).parent / "corpus" / "tokenizers"
REAL = {  # eos, bos, the ids transformers puts before a document (read off AutoTokenizer: -m reference)
    "gpt2": (("<|endoftext|>", 3000), ("<|endoftext|>", 3000), []),
    "pythia": (("<|endoftext|>", 0), ("<|endoftext|>", 0), []),  # add_bos_token: false rebuilds it
    "openllama": (("</s>", 2), ("</s>", 2), [2]),  # special_tokens_map.json's bos over the config's <s>
    "bora": (("</s>", 2), ("<s>", 1), []),  # add_bos_token, but a class that ignores it
}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<s>", "</s>", "<bos>", "<eos>", "<|im_end|>"]
FIXTURES = {  # the config each family publishes (its shape), over a BPE with all of SPECIALS
    "llama3": ({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>"}, "<|begin_of_text|> $A", ("<|end_of_text|>", "<|begin_of_text|>", True)),
    "mistral": ({"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
                 "bos_token": "<s>", "eos_token": "</s>"}, None, ("</s>", "<s>", True)),
    "gemma": ({"tokenizer_class": "GemmaTokenizer"}, None, ("<eos>", "<bos>", True)),  # the class's defaults
    "qwen2": ({"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": {
        "__type": "AddedToken", "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False}}, None, ("<|im_end|>", None, False)),
}  # fmt: skip


def _docs(directory: Path) -> list[list[int]]:
    """The documents in the shards, as id lists (each with what closes it)."""
    _, stream, _ = S.open_shards(directory)
    ids = stream.read(0, len(stream)).tolist()
    ends = S.documents(directory).tolist()
    return [ids[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Each real tokenizer's shards of the embedded corpus (79 documents, 512 kB)."""
    root = tmp_path_factory.mktemp("real")
    for name in REAL:
        prepare([], root / name, tokenizer=str(HERE / name / "tokenizer.json"))
    return root


@pytest.mark.parametrize("name", list(REAL))
def test_real_tokenizers_give_the_tokenizers_librarys_ids(prepared, name):
    from tokenizers import Tokenizer

    eos, bos, prefix = REAL[name]
    manifest = json.loads((prepared / name / S.MANIFEST).read_text())
    assert manifest["special"] == {"eos": list(eos), "bos": list(bos), "prefix": prefix, "suffix": [eos[1]]}
    assert manifest["eot_id"] == eos[1]
    hf = Tokenizer.from_file(str(HERE / name / "tokenizer.json"))
    texts = default_documents()
    want = [prefix + e.ids + [eos[1]] for e in hf.encode_batch(texts, add_special_tokens=False)]
    docs = _docs(prepared / name)
    assert len(docs) == len(texts) == 79 and docs == want  # every id of every document
    data = load(str(prepared / name))
    assert [data.decode(d[len(prefix) : -1]) for d in docs] == texts  # and back to the text, exactly
    assert data.encode(texts[0]).tolist() == docs[0][:-1]  # a prompt starts as a document does
    special = special_tokens(SimpleNamespace(corpus=data, cfg=C.tiny()))
    assert (special.eos, special.bos) == (eos, bos)  # what an export names


@pytest.mark.parametrize("name", list(REAL))
def test_documents_encoded_in_pieces_decode_exactly(tmp_path, monkeypatch, name):
    """A document longer than a piece is encoded in pieces cut after a newline: a SentencePiece-style
    tokenizer puts no space before a piece that goes on a document (it did before: 29 of the 79
    documents decoded with spaces added, in pieces of 3,000 characters, with openllama)."""
    from meshkit.data import prepare as P
    from meshkit.data import readers

    monkeypatch.setattr(readers, "PIECE", 3000)
    monkeypatch.setattr(P, "BATCH", 20000)
    prepare([], tmp_path / "out", tokenizer=str(HERE / name))
    data, texts = load(str(tmp_path / "out")), default_documents()
    docs = [d[:-1] for d in _docs(tmp_path / "out")]
    assert [data.decode(d[len(data.bpe.prefix) :]) for d in docs] == texts
    if name in ("openllama", "bora"):  # no merges across a newline: the ids of the whole documents too
        assert docs == [data.encode(t).tolist() for t in texts]


def test_shards_prepared_before_issue_36_still_open_and_a_changed_config_is_refused(tmp_path, capsys):
    """A manifest without ``special`` and no tokenizer_config.json (meshkit's own BPE, before): the
    end-of-text token it always had. A tokenizer_config.json changed after preparing: one line."""
    prepare([], tmp_path / "old", vocab_size=300)
    manifest = json.loads((tmp_path / "old" / S.MANIFEST).read_text())
    del manifest["special"]
    (tmp_path / "old" / S.MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "old" / "tokenizer_config.json").unlink()
    assert load(str(tmp_path / "old")).bpe.eos == ("<|endoftext|>", manifest["eot_id"])
    prepare([], tmp_path / "new", tokenizer=str(HERE / "gpt2"))
    (tmp_path / "new" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))  # fmt: skip
    with pytest.raises(
        DataError, match=r"BOS None \(\[\] first\) but the shards were made with 3001 ids, end of text"
    ):
        load(str(tmp_path / "new"))


def _fixture(root: Path, name: str) -> Path:
    from tokenizers import processors

    config, template, _ = FIXTURES[name]
    bpe = train_bpe(default_documents()[:6], 400)
    tok = bpe._tok
    tok.add_special_tokens(SPECIALS)
    if template is not None:
        first = template.split()[0]
        tok.post_processor = processors.TemplateProcessing(
            single=template,
            pair=f"{template} {first}:1 $B:1",
            special_tokens=[(first, tok.token_to_id(first))],
        )
    (root / name).mkdir()
    tok.save(str(root / name / "tokenizer.json"))
    (root / name / "tokenizer_config.json").write_text(json.dumps(config))
    return root / name


@pytest.mark.parametrize("name", list(FIXTURES))
def test_each_familys_config_names_its_tokens(tmp_path, name):
    eos, bos, prepends = FIXTURES[name][2]
    src = _fixture(tmp_path, name)
    manifest = prepare([], tmp_path / "out", tokenizer=str(src))  # a directory holding tokenizer.json
    ids = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
    vocab = {t["content"]: t["id"] for t in ids}
    assert manifest["special"]["eos"] == [eos, vocab[eos]]
    assert manifest["special"]["bos"] == (None if bos is None else [bos, vocab[bos]])
    assert manifest["special"]["prefix"] == ([vocab[bos]] if prepends else [])
    docs = _docs(tmp_path / "out")
    assert all(d[-1] == vocab[eos] for d in docs) and all((d[0] == vocab.get(bos)) == prepends for d in docs)
    again = load(str(tmp_path / "out")).bpe  # the shards' own tokenizer.json and tokenizer_config.json
    assert (again.eos, again.bos, again.prefix) == ((eos, vocab[eos]), bos and (bos, vocab[bos]), tuple(manifest["special"]["prefix"]))  # fmt: skip


def test_eos_and_bos_flags_override_the_config(tmp_path):
    src = _fixture(tmp_path, "llama3")
    manifest = prepare([], tmp_path / "out", tokenizer=str(src), eos_token="<|im_end|>", bos_token="<s>")
    vocab = {t["content"]: t["id"] for t in json.loads((src / "tokenizer.json").read_text())["added_tokens"]}
    assert manifest["special"]["eos"] == ["<|im_end|>", vocab["<|im_end|>"]]
    assert manifest["special"]["bos"] == ["<s>", vocab["<s>"]]
    assert manifest["special"]["prefix"] == [vocab["<|begin_of_text|>"]]  # the post-processor's own BOS


# Tiers: sweeps (moved when make test measured 22 min): a Llama trained on shards of Llama 3's tokenizer and
# exported with its end and beginning of text is core in test_sft_train.py's
# test_meshkit_train_task_sft_on_prepared_conversations (--export-hf), meshkit generate through a run's
# tokenizer in test_llama_cli.py's test_a_llama_on_bpe_token_shards_exports_its_tokenizer_generates_and_...,
# the export's special tokens where transformers reads them in test_export_special.py, each family's end and
# beginning of text read from its tokenizer_config.json in test_each_familys_config_names_its_tokens.
@pytest.mark.sweep
def test_a_run_on_them_trains_generates_and_exports_its_tokens(tmp_path, capsys):
    """Shards of a Llama 3 shaped tokenizer: a Llama trains on them, generates from a prompt that starts
    with the BOS id, and its export names that BOS and end of text."""
    src = _fixture(tmp_path, "llama3")
    manifest = prepare([], tmp_path / "data", tokenizer=str(src))
    (eos, eos_id), (bos, bos_id) = manifest["special"]["eos"], manifest["special"]["bos"]
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--model", "llama", "--kv-heads", "2", "--data", str(tmp_path / "data"),
                 "--seq-len", "32", "--steps", "2", "--eval-every", "0", "--sample-chars", "0", "--export-hf",
                 "--run-dir", str(run)]) == 0  # fmt: skip
    config = json.loads((run / "hf" / "config.json").read_text())
    tok_cfg = json.loads((run / "hf" / "tokenizer_config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (eos_id, bos_id)
    assert (
        (tok_cfg["eos_token"], tok_cfg["bos_token"]) == (eos, bos) == ("<|end_of_text|>", "<|begin_of_text|>")
    )
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()  # four tokens' text


def _one_line_exit_2(capsys, argv, match):
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err


def _bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    good = str(HERE / "openllama" / "tokenizer.json")
    (root / "notok").mkdir()
    (root / "notok" / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0}}))
    (root / "badcfg").mkdir()
    (root / "badcfg" / "tokenizer.json").write_text((HERE / "gpt2" / "tokenizer.json").read_text())
    (root / "badcfg" / "tokenizer_config.json").write_text("{not json")
    (root / "nobos").mkdir()
    (root / "nobos" / "tokenizer.json").write_text((HERE / "gpt2" / "tokenizer.json").read_text())
    (root / "nobos" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>"}))  # fmt: skip
    return {
        "eos": (["--tokenizer", good, "--eos-token", "<|eot_id|>"], "has no <|eot_id|> token: name its end-of-text token with --eos-token (its special tokens: </s>, <s>, <unk>, [PAD])"),
        "bos": (["--tokenizer", good, "--bos-token", "<bos>"], "has no <bos> token: name its beginning-of-text token with --bos-token"),
        "missing": (["--tokenizer", str(root / "none.json")], "no tokenizer file"),
        "not a tokenizer": (["--tokenizer", str(root / "notok" / "tokenizer.json")], "is not a tokenizer.json"),
        "bad config": (["--tokenizer", str(root / "badcfg")], "tokenizer_config.json' is not JSON"),
        "no bos": (["--tokenizer", str(root / "nobos")], "add_bos_token is true but no bos_token is named: give --bos-token"),
        "no tokenizer": (["--eos-token", "</s>"], "--eos-token names a token of --tokenizer: give --tokenizer too"),
    }  # fmt: skip


@pytest.mark.parametrize(
    "case", ["eos", "bos", "missing", "not a tokenizer", "bad config", "no bos", "no tokenizer"]
)
def test_bad_tokenizer_input_is_one_line_and_writes_nothing(tmp_path, capsys, case):
    (tmp_path / "in").mkdir()
    text = tmp_path / "in" / "a.txt"
    text.write_text(default_documents()[0])
    args, match = _bad_inputs(tmp_path / "in")[case]
    _one_line_exit_2(capsys, ["data", "prepare", str(text), "--out", str(tmp_path / "out"), *args], match)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no --out, no partial directory


def _export(shards: Path, out: Path) -> Path:
    """What ``meshkit export`` writes for a run on ``shards``: its tokenizer.json with the special tokens
    it names (a tiny Llama's weights beside them)."""
    import jax

    from meshkit import interop
    from meshkit.models import llama

    data = load(str(shards))
    special = special_tokens(SimpleNamespace(corpus=data, cfg=C.tiny()))
    cfg = llama.LlamaConfig(vocab_size=data.vocab_size, seq_len=16, layers=1, width=16, heads=2, ffn=32)
    interop.save(
        llama.init(jax.random.key(0), cfg), cfg, out, tokenizer_json=data.bpe.to_str(), special=special
    )
    return out


_REFERENCE = """
import json, sys
from transformers import AutoTokenizer
texts, out = json.load(open(sys.argv[1])), {}
for d in sys.argv[2:]:
    t = AutoTokenizer.from_pretrained(d)
    out[d] = {"eos": [t.eos_token, t.eos_token_id], "bos": [t.bos_token, t.bos_token_id],
              "ids": [ids + [t.eos_token_id] for ids in t(texts)["input_ids"]]}
print(json.dumps(out))
"""


READ_OTHERWISE_BY_5 = {"openllama", "mistral", "gemma", "qwen2"}
"""Source directories transformers 5.x reads otherwise than 4.x (measured with 5.25.0): its tokenizer
classes named by tokenizer_config.json (LlamaTokenizer, GemmaTokenizer, Qwen2Tokenizer) rebuild the
pipeline around tokenizer.json's vocabulary (openllama: BOS ``<s>`` 1 where 4.x and meshkit put the
special_tokens_map's ``</s>`` 2; the fixtures, BPEs not made for those classes: no BOS, another
pre-tokenizer, no ``<unk>``). ``meshkit data prepare`` follows 4.x there; what meshkit writes (the
shards' directories, exports) reads the same in both."""


# Tiers: sweeps; the shards' ids are the tokenizers library's for each published directory in
# test_real_tokenizers_give_the_tokenizers_librarys_ids, each family's end and beginning of text read from
# its tokenizer_config.json as transformers reads them in test_each_familys_config_names_its_tokens, an
# export's special tokens where transformers reads them in test_export_special.py; AutoTokenizer itself on
# a meshkit export is core in test_chat_template.py's test_ids_equal_transformers_apply_chat_template.
@pytest.mark.sweep
@pytest.mark.reference
def test_transformers_autotokenizer_gives_the_shards_ids(prepared, tmp_path, reference_python):
    """The tokenizer directories as published (HERE), the fixtures, the shards' own directory (its
    tokenizer.json and tokenizer_config.json) and an export of a run on them: AutoTokenizer's ids are
    the shards' ids, document by document, and its eos and bos are the manifest's (with 5.x: but for
    the sources of ``READ_OTHERWISE_BY_5``)."""
    py = reference_python
    five = Path(py).parents[1].name == REFERENCES["transformers5"]
    texts = default_documents()
    cases = {HERE / n: prepared / n for n in REAL if not (five and n in READ_OTHERWISE_BY_5)}
    cases |= {prepared / n: prepared / n for n in REAL}
    cases |= {_export(prepared / n, tmp_path / f"{n}-hf"): prepared / n for n in ("openllama", "gpt2")}
    for name in FIXTURES:
        src = _fixture(tmp_path, name)
        prepare([], tmp_path / f"{name}-out", tokenizer=str(src))
        cases |= {tmp_path / f"{name}-out": tmp_path / f"{name}-out"}
        if not (five and name in READ_OTHERWISE_BY_5):
            cases |= {src: tmp_path / f"{name}-out"}
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    done = subprocess.run([py, "-c", _REFERENCE, str(tmp_path / "texts.json"), *map(str, cases)],
                          capture_output=True, text=True, timeout=limit(8))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ref = json.loads(done.stdout.splitlines()[-1])
    for src, shards in cases.items():
        special = json.loads((shards / S.MANIFEST).read_text())["special"]
        got = ref[str(src)]
        assert got["eos"] == special["eos"], src
        assert got["bos"] == (special["bos"] or [None, None]), src
        assert got["ids"] == _docs(shards), src  # every id of every document
