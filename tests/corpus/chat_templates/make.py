"""Build the chat-template fixtures beside this file from ``src/*.jinja`` (the templates, verbatim) and
the trimmed tokenizers of ``tests/corpus/tokenizers`` with each family's special tokens added (README.md).

    python tests/corpus/chat_templates/make.py [NAME...]   # all of them, or those named
"""

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

HERE = Path(__file__).resolve().parent
TOKENIZERS = HERE.parent / "tokenizers"
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
DEEPSEEK_PLAIN = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                  "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                  "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
"""DeepSeek-V3's and R1's added tokens: BOS and EOS special, the chat and tool markers added as plain tokens."""
FIXTURES = {  # name: (template, base tokenizer, special tokens added, other added tokens, bos, eos, where)
    "llama3": ("nemotron", "gpt2", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eot_id|>"], [], "<|begin_of_text|>", "<|eot_id|>", "config"),
    "qwen3": ("qwen3", "gpt2", ["<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], None, "<|im_end|>",
              "jinja"),
    "gemma2": ("gemma2", "openllama", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], [], "<bos>",
               "<eos>", "config"),
    "qwen1_5": ("qwen1_5", "gpt2", ["<|im_start|>", "<|im_end|>"], [], None, "<|im_end|>", "config"),
    "smollm3": ("smollm3", "gpt2", ["<|im_start|>", "<|im_end|>"], ["<think>", "</think>"], None, "<|im_end|>",
                "jinja"),
    "llama3_training": ("llama3_training", "gpt2", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"], [], "<|begin_of_text|>", "<|eot_id|>", "jinja"),
    "deepseek": ("deepseekv3", "gpt2", DEEPSEEK_SPECIAL, DEEPSEEK_PLAIN, "<｜begin▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", "config"),
    "deepseek_training": ("deepseekv3_training", "gpt2", DEEPSEEK_SPECIAL, DEEPSEEK_PLAIN,
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "jinja"),
}


def make(name: str) -> None:
    template, base, special, plain, bos, eos, where = FIXTURES[name]
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    tok = Tokenizer.from_file(str(TOKENIZERS / base / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    source = (HERE / "src" / f"{template}.jinja").read_text(encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "pad_token": eos, "clean_up_tokenization_spaces": False}
    if where == "config":
        config["chat_template"] = source
    else:
        (out / "chat_template.jinja").write_text(source, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    import sys

    for n in sys.argv[1:] or FIXTURES:
        make(n)
