"""`meshkit train --model llama`, `--export-hf`, `--init-from hf:DIR`, `meshkit export` and
`meshkit generate` through the real command; bad checkpoints are one line, exit 2, nothing written."""

import json
import shutil

import jax
import numpy as np
import pytest

from meshkit import interop
from meshkit.cli import main
from meshkit.models import gpt, llama
from meshkit.train import config as C
from meshkit.train.job import prepare
from meshkit.train.outputs import load_run

LLAMA = ["--preset", "tiny", "--model", "llama", "--kv-heads", "2", "--plan", "fsdp+tp"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained 4 steps under fsdp+tp (data=4,model=2) and exported at the end."""
    run = tmp_path_factory.mktemp("llama") / "run"
    code = main(["train", *LLAMA, "--steps", "4", "--eval-every", "0", "--checkpoint-every", "4",
                 "--sample-chars", "0", "--export-hf", "--run-dir", str(run)])  # fmt: skip
    assert code == 0
    return run


def test_llama_run_trains_proves_its_cost_and_exports(trained, capsys):
    report = json.loads((trained / "report.json").read_text())
    assert report["checks_ok"] and report["mesh"] == {"data": 4, "model": 2}
    assert report["final_loss"] < report["initial_loss"]
    rows = {(c["op"], c["axes"]): c for c in report["communication"]}
    assert rows["all-reduce", "model"]["ok"]  # the vocabulary split's rows included
    config = json.loads((trained / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    exported, _ = interop.load(trained / "hf")
    run = load_run(trained)
    assert run.step == 4 and isinstance(run.model, llama.LlamaConfig)
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), run.params, exported)
    assert all(jax.tree.leaves(same))  # the export is the checkpoint, bitwise
    assert interop.read_vocab(trained / "hf") == run.vocab


def test_meshkit_export_and_generate_on_the_run(trained, tmp_path, capsys):
    out = tmp_path / "again"
    assert main(["export", str(trained), str(out), "--to", "hf", "--shard-mb", "0.01"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 2
    capsys.readouterr()
    prompts = ["def ", "The class"]
    assert main(["generate", "--run-dir", str(trained), "--prompt", prompts[0], "--prompt", prompts[1],
                 "--max-new-tokens", "7"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(len(line) == 7 for line in lines), lines
    # greedy: the same continuation as the full forward pass, token by token
    run = load_run(trained)
    from meshkit.data.text import encode

    ids = encode(prompts[1] + lines[1], run.vocab)
    logits = llama.apply(run.params, ids[None, :-1], run.model)[0]
    assert np.argmax(logits[len(prompts[1]) - 1 :], -1).tolist() == ids[len(prompts[1]) :].tolist()


def test_init_from_the_export_starts_from_its_weights(trained, tmp_path):
    """prepare() reads the checkpoint into the plan's layout (another plan than the run's)."""
    cfg = C.tiny().replace(model="llama", kv_heads=2, plan="zero3", init_from=f"hf:{trained / 'hf'}",
                           run_dir=str(tmp_path / "next"))  # fmt: skip
    job = prepare(cfg)
    want = load_run(trained).params
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(job.trainer.params), jax.tree.leaves(want), strict=True)
    )
    assert not (tmp_path / "next").exists()


@pytest.mark.parametrize("plan", ["fsdp+tp", "dp+pp"])
def test_init_from_reads_each_devices_block_into_the_trainers_layout(tmp_path, plan):
    """The checkpoint is read straight into the layout the Trainer keeps (global arrays with its
    shardings: each device's block read from the files, no host copy of the model), under a pipeline
    plan (the scanned form, split over the stages) too; the Trainer's parameters are those weights."""
    from meshkit.data import load
    from meshkit.train.job import build_model

    chars = load(C.tiny().data.data).chars
    model = llama.LlamaConfig(
        vocab_size=len(chars), seq_len=64, layers=2, width=32, heads=4, kv_heads=2, ffn=64
    )
    interop.save(llama.init(jax.random.key(3), model), model, tmp_path / "ckpt", vocab=chars)
    cfg = C.tiny().replace(model="llama", layers=2, width=32, heads=4, kv_heads=2, plan=plan,
                           init_from=f"hf:{tmp_path / 'ckpt'}", run_dir=str(tmp_path / "next"))  # fmt: skip
    job = prepare(cfg)
    _, _, params, _ = build_model(cfg, job.family, job.data.vocab_size)
    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(job.trainer.params), strict=True))
    assert all(isinstance(a, jax.Array) and a.sharding == b.sharding for a, b in pairs)
    assert any(not a.sharding.is_fully_replicated for a, _ in pairs)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)


def _gpt2_checkpoint(where):
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=32, layers=1, width=32, heads=4)
    interop.save(gpt.init(jax.random.key(0), cfg), cfg, where)


@pytest.mark.parametrize(
    ("break_it", "args", "message"),
    [
        ("gpt2", [], "holds a GPT-2 checkpoint but --model is llama: give --model gpt"),
        ("bert", [], "model_type 'bert' (architectures: BertModel) is not one meshkit reads"),
        ("drop-shard", [], "shard(s) named by model.safetensors.index.json are missing"),
        ("ffn", [], "but the config makes it"),
        ("no-vocab", [], "has no meshkit_vocab.json, so its token ids do not match"),
        ("vocab", [], "the checkpoint's character vocabulary (104 characters) is not the data's"),
        ("none", ["--width", "64"], "the checkpoint's shape is not the run's (--width 64): give --width 32"),
    ],
)
def test_bad_checkpoint_is_one_line_exit_2_and_writes_nothing(
    trained, tmp_path, capsys, break_it, args, message
):
    ckpt = tmp_path / "ckpt"
    if break_it == "gpt2":
        _gpt2_checkpoint(ckpt)
    else:
        main(["export", str(trained), str(ckpt), "--shard-mb", "0.01"])
    config = json.loads((ckpt / "config.json").read_text())
    if break_it == "bert":
        (ckpt / "config.json").write_text(
            json.dumps({**config, "model_type": "bert", "architectures": ["BertModel"]})
        )
    elif break_it == "drop-shard":
        sorted(ckpt.glob("model-*.safetensors"))[1].unlink()
    elif break_it == "ffn":
        (ckpt / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    elif break_it == "no-vocab":
        (ckpt / "meshkit_vocab.json").unlink()
    elif break_it == "vocab":
        chars = json.loads((ckpt / "meshkit_vocab.json").read_text())
        (ckpt / "meshkit_vocab.json").write_text(json.dumps(chars[::-1]))
    capsys.readouterr()
    run = tmp_path / "run"
    code = main(["train", *LLAMA, "--init-from", f"hf:{ckpt}", "--run-dir", str(run), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not run.exists()


def test_export_refuses_a_used_directory_and_leaves_it_alone(trained, tmp_path, capsys):
    out = tmp_path / "used"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(trained), str(out)]) == 2
    assert "already exists and is not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".used")]  # no half-written sibling
    shutil.rmtree(out)


def test_meshkit_generate_streams_a_prompt_and_stops_before_a_stop_string(trained, capsys):
    """One prompt's continuation is shown as each token settles (``generate_text(show=)``, what the command
    writes to stdout) and printed whole; ``--stop TEXT`` cuts it before the text and stops drawing there."""
    from meshkit.models.generate import Sampling
    from meshkit.train.outputs import generate_text

    args = ["generate", "--run-dir", str(trained), "--prompt", "The class", "--max-new-tokens", "16",
            "--temperature", "1", "--seed", "5"]  # fmt: skip
    assert main(args) == 0
    full = capsys.readouterr().out
    assert full.endswith("\n") and len(full) == 17, full  # 16 characters, each a token
    run, shown = load_run(trained), []
    how = Sampling(temperature=1.0)
    texts = generate_text(run, ["The class"], 16, sampling=how, seed=5, show=lambda row, t: shown.append(t))
    assert texts == [full[:-1]] and shown == [full[:n] for n in range(1, 17)]  # one text per token, growing
    stop = full[6:8]
    cut = full.index(stop)
    assert main([*args, "--stop", stop, "--stop", "never in it"]) == 0
    assert capsys.readouterr().out == full[:cut] + "\n"
    shown.clear()
    generate_text(
        run, ["The class"], 16, sampling=how, seed=5, stop_strings=[stop], show=lambda r, t: shown.append(t)
    )
    assert len(shown) == cut + len(stop) and shown[-1] == full[:cut]  # no token drawn after the stop string
    assert main([*args, "--stop", ""]) == 2
    assert "empty stop string" in capsys.readouterr().err


def test_a_llama_on_bpe_token_shards_exports_its_tokenizer_generates_and_restarts_only_on_it(
    tmp_path, capsys
):
    """The two halves of issues 24 and 25 together: prepare BPE shards, train the Llama on them, export
    with the run's tokenizer.json (as the Hub ships one: loadable by ``tokenizers``), generate text
    through that tokenizer, and start again from the export only on data of the same tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer

    from meshkit.data.prepare import prepare as prepare_data
    from meshkit.data.text import default_documents

    docs = tmp_path / "docs"
    docs.mkdir()
    for i, doc in enumerate(default_documents()[:12]):
        (docs / f"{i}.txt").write_text(doc)
    prepare_data([str(docs)], tmp_path / "bpe", vocab_size=300, shard_tokens=4000)
    run = tmp_path / "run"
    assert main(["train", *LLAMA, "--data", str(tmp_path / "bpe"), "--seq-len", "32", "--steps", "2",
                 "--eval-every", "0", "--sample-chars", "0", "--export-hf", "--run-dir", str(run)]) == 0  # fmt: skip
    hf = run / "hf"
    ours = load_run(run).corpus.bpe
    theirs = HFTokenizer.from_file(str(hf / interop.hf.TOKENIZER))
    text = "def f(x):\n    return x"
    assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text).tolist()
    assert not (hf / interop.hf.VOCAB).exists()  # no character vocabulary for BPE data
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert len(ours.encode(line)) >= 1  # five BPE tokens, decoded
    # a restart from the export: on the same shards it starts from the exported weights...
    cfg = C.tiny().replace(model="llama", kv_heads=2, plan="dp", data=str(tmp_path / "bpe"), seq_len=32,
                           init_from=f"hf:{hf}", run_dir=str(tmp_path / "next"))  # fmt: skip
    assert prepare(cfg).trainer is not None
    # ...and on shards of another tokenizer it is one line, exit 2, nothing written
    prepare_data([str(docs)], tmp_path / "other", vocab_size=290, shard_tokens=4000)
    code = main(["train", *LLAMA, "--data", str(tmp_path / "other"), "--seq-len", "32", "--steps", "2",
                 "--init-from", f"hf:{hf}", "--run-dir", str(tmp_path / "bad")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "is not the checkpoint's" in err and err.count("\n") == 1, err
    assert not (tmp_path / "bad").exists()
