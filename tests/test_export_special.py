"""An export names the run's end (and beginning) of text (issue 39): in config.json, in
generation_config.json and, beside its tokenizer.json, in tokenizer_config.json, carried over from
the checkpoint a run started from (``--init-from``) where that checkpoint names them.
(transformers reading such an export: tests/test_hf_reference.py.)"""

import json
from types import SimpleNamespace

import jax

from meshkit import interop
from meshkit.data.text import default_documents
from meshkit.data.tokenizer import EOT, Tokenizer, train_bpe
from meshkit.models import llama
from meshkit.train.outputs import special_tokens


def _bpe_with_bos() -> Tokenizer:
    bpe = train_bpe(default_documents()[:4], 300)
    tok = bpe._tok
    tok.add_special_tokens(["<|begin_of_text|>"])
    return Tokenizer(tok, "test")


def _run(bpe, init_from=None):
    return SimpleNamespace(corpus=SimpleNamespace(bpe=bpe, chat=False),
                           cfg=SimpleNamespace(model=SimpleNamespace(init_from=init_from), data=SimpleNamespace(data=None)))  # fmt: skip


def test_a_runs_own_tokenizer_gives_its_end_of_text():
    bpe = train_bpe(default_documents()[:4], 300)
    special = special_tokens(_run(bpe))
    assert special.eos == (EOT, bpe.eot_id) and special.bos is None
    assert special_tokens(_run(None)) is None  # character data has no end-of-text token


def test_the_checkpoint_a_run_started_from_names_its_bos_and_eos(tmp_path):
    bpe = _bpe_with_bos()
    begin = bpe.vocab_size - 1
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 7, "eos_token_id": 9}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": begin, "eos_token_id": [bpe.eot_id, 3]})
    )
    special = special_tokens(_run(bpe, f"hf:{tmp_path}"))
    assert special.bos == ("<|begin_of_text|>", begin) and special.eos == (EOT, bpe.eot_id)
    # ids that are no special token of the tokenizer (a config's defaults) are not taken for them
    (tmp_path / "generation_config.json").unlink()
    special = special_tokens(_run(bpe, f"hf:{tmp_path}"))
    assert special.bos is None and special.eos == (EOT, bpe.eot_id)


def test_save_writes_the_special_tokens_where_transformers_reads_them(tmp_path):
    bpe = _bpe_with_bos()
    cfg = llama.LlamaConfig(vocab_size=bpe.vocab_size, seq_len=16, layers=1, width=16, heads=2, ffn=32)
    begin = bpe.vocab_size - 1
    special = interop.hf.Special(eos=(EOT, bpe.eot_id), bos=("<|begin_of_text|>", begin))
    interop.save(
        llama.init(jax.random.key(0), cfg), cfg, tmp_path / "hf", tokenizer_json=bpe.to_str(), special=special
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == bpe.eot_id
    assert config["bos_token_id"] == generation["bos_token_id"] == begin
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast" and tok["add_bos_token"] is False
    assert (tok["eos_token"], tok["bos_token"]) == (EOT, "<|begin_of_text|>")
    assert interop.hf.read_special(tmp_path / "hf") == {"bos_token_id": begin, "eos_token_id": bpe.eot_id}
