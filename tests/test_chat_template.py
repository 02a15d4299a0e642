"""Chat templates (issue 37): real templates rendered and tokenised as transformers'
``apply_chat_template`` does (``-m reference``: against transformers 5.x and 4.57), the assistant-only
loss mask (a template's ``{% generation %}`` tags as transformers 5.x reads them, else the turns found by
rendering prefixes, each ending with its end of turn), prompt/completion rows, and bad rows refused in
one line naming the row and the fix."""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import REFERENCES
from meshkit.data.chat import Encoder, read_row
from meshkit.data.chat_template import load_template
from meshkit.data.source import DataError
from meshkit.data.tokenizer import load_tokenizer

TEMPLATES = Path(__file__).parent / "corpus" / "chat_templates"
FAMILIES = ("llama3", "qwen3", "gemma2")
END = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma2": "<end_of_turn>"}
SYSTEM = {"role": "system", "content": 'You are terse. Ünïcode <b>ok</b> & "quoted".'}
TURNS = [
    {"role": "user", "content": "Hi there, what's 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And  3*3?\nThanks"},
    {"role": "assistant", "content": "9, of course."},
]


def _encoder(name: str) -> Encoder:
    return Encoder(load_tokenizer(TEMPLATES / name), load_template(TEMPLATES / name))


def _ids(enc: Encoder, messages, generation: bool) -> list[int]:
    if generation:
        return enc.prompt_ids(messages).tolist()
    return enc.tokenizer.encode_offsets(enc.template.render(messages), special=True)[0].tolist()


def _cases() -> list[tuple[str, list, bool]]:
    """(family, messages, add_generation_prompt): with a system message (Gemma's template refuses one),
    multi-turn, and ending at a user turn with the generation prompt."""
    out = []
    for name in FAMILIES:
        convo = TURNS if name == "gemma2" else [SYSTEM, *TURNS]
        out += [(name, convo, False), (name, convo[:-1], True), (name, convo[:2], False)]
    return out


OVERRIDE = {"role": "system", "content": "You are terse. /system_override"}
"""SmolLM3's system message that replaces its metadata block (whose date, strftime_now, would differ
between meshkit's render and the reference's across midnight)."""
TOOLS = [
    TURNS[0],
    {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "content": "4"},
    {"role": "assistant", "content": "It is 4.", "tool_calls": None},
]  # fmt: skip
NULLS = [TURNS[0], {**TURNS[1], "tool_calls": None}, TURNS[2], {**TURNS[3], "tool_calls": None}]
"""OpenAI-style messages: ``"tool_calls": null`` where there is none (transformers 5.x drops the key)."""
REASONS = [SYSTEM, TURNS[0], {**TURNS[1], "reasoning": "2 and 2 make 4."}]
"""A reasoning under the name transformers 5.x reads as ``reasoning_content`` (Qwen3's template renders it)."""

_REFERENCE = """
import json, sys
from transformers import AutoTokenizer, PreTrainedTokenizerFast
out = []
for d, messages, gen, masks, fast in json.loads(sys.stdin.read()):
    tok = (PreTrainedTokenizerFast if fast else AutoTokenizer).from_pretrained(d)
    try:
        got = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True,
                                      return_assistant_tokens_mask=masks)
    except Exception as e:
        out.append({"error": type(e).__name__})
        continue
    out.append({"ids": list(map(int, got["input_ids"])), "mask": list(map(int, got.get("assistant_masks") or []))})
print(json.dumps(out))
"""


def _reference_cases(root: Path) -> dict[str, tuple]:
    """Every case of the reference tests, by name: (directory, messages, add_generation_prompt,
    return_assistant_tokens_mask, load as PreTrainedTokenizerFast), run in one transformers process."""
    cases = {f"ids/{n}/{i}": (str(TEMPLATES / n), m, g, False, False) for i, (n, m, g) in enumerate(_cases())}
    tagged = {"gemma2-generation": [TURNS, TURNS[:2]], "smollm3": [[OVERRIDE, *TURNS], [OVERRIDE, *TURNS[:2]]],
              "llama3_training": [TURNS, [SYSTEM, *TURNS]], "deepseek_training": [TURNS, TOOLS, NULLS]}  # fmt: skip
    for n, convos in tagged.items():
        d = root / n if n == "gemma2-generation" else TEMPLATES / n
        cases |= {f"mask/{n}/{i}": (str(d), m, False, True, False) for i, m in enumerate(convos)}
    cases["5.x/nulls"] = (str(TEMPLATES / "deepseek"), NULLS, False, False, False)
    cases["5.x/reasoning"] = (str(TEMPLATES / "qwen3"), REASONS, False, False, False)
    cases["llama/auto"] = (str(root / "openllama-mistral"), TURNS, False, False, False)
    cases["llama/fast"] = (str(root / "openllama-mistral"), TURNS, False, False, True)
    cases["export/llama3"] = (str(root / "export"), TURNS, True, False, False)
    return cases


def _export(directory: Path) -> None:
    """An export of a model fine-tuned on llama3's conversations, as ``meshkit export`` writes it (the merged
    export of a LoRA run dropped the template and the padding token: ``apply_chat_template`` raised)."""
    import jax

    from meshkit import interop
    from meshkit.data.prepare import carried_tokens
    from meshkit.models import llama

    tok, template = load_tokenizer(TEMPLATES / "llama3"), load_template(TEMPLATES / "llama3")
    cfg = llama.LlamaConfig(vocab_size=tok.vocab_size, seq_len=16, layers=1, width=16, heads=2, ffn=32)
    special = interop.hf.Special(eos=(tok.eos[0], tok.eot_id), named=carried_tokens(tok, TEMPLATES / "llama3"),
                                 chat_template=template.source)  # fmt: skip
    interop.save(
        llama.init(jax.random.key(0), cfg), cfg, directory, tokenizer_json=tok.to_str(), special=special
    )


def _reference(python: str, cases: list) -> list:
    run = subprocess.run([python, "-c", _REFERENCE], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def theirs(reference_python, tmp_path_factory):
    """(whether it is transformers 5.x, {case name: (case, transformers' ids and mask or error)})."""
    root = tmp_path_factory.mktemp("chat-reference")
    _generation_template(root / "gemma2-generation")
    _export(root / "export")
    shutil.copytree(Path(__file__).parent / "corpus" / "tokenizers" / "openllama", root / "openllama-mistral")
    shutil.copy(TEMPLATES / "src" / "mistral_v0_1.jinja", root / "openllama-mistral" / "chat_template.jinja")
    cases = _reference_cases(root)
    got = _reference(reference_python, list(cases.values()))
    five = Path(reference_python).parents[1].name == REFERENCES["transformers5"]
    return five, {name: (case, out) for (name, case), out in zip(cases.items(), got, strict=True)}


def _mine(case: tuple) -> tuple[list[int], list[int]]:
    """meshkit's ids (the template's render tokenised) and, for a mask case, its encoded row's mask."""
    d, messages, generation, masks, _ = case
    enc = Encoder(load_tokenizer(d), load_template(d))
    if masks:
        ids, mask = enc.encode(read_row({"messages": messages}, "case"))
        return ids.tolist(), mask.tolist()
    return _ids(enc, messages, generation), []


@pytest.mark.reference
def test_ids_equal_transformers_apply_chat_template(theirs):
    """Token ids of three families' real templates (Llama 3.3, Qwen3, Gemma 2), and of an export of a model
    fine-tuned on one (its template and padding token carried), equal transformers' apply_chat_template."""
    _, cases = theirs
    for name, (case, out) in cases.items():
        if name.startswith(("ids/", "export/")):
            assert _mine(case)[0] == out["ids"], name
    export = Path(cases["export/llama3"][0][0])
    assert json.loads((export / "tokenizer_config.json").read_text())["pad_token"] == "<|eot_id|>"


@pytest.mark.reference
def test_generation_masks_equal_transformers_assistant_masks(theirs):
    """On templates with {% generation %} tags (SmolLM3's, TRL's Llama 3 and DeepSeek-V3 training
    templates, Gemma 2's with tags added), the ids and the mask equal transformers' input_ids and
    assistant_masks: 9 conversations, tool calls and null keys among them (those under 5.x only: 4.57
    keeps the null and the template fails on it). SmolLM3's tags take in the
    assistant header and the newline after <|im_end|> (meshkit's rendered turns did not, before)."""
    five, cases = theirs
    masked = {name: v for name, v in cases.items() if name.startswith("mask/")}
    assert len(masked) == 9
    for name, (case, out) in masked.items():
        if not five and any(None in m.values() for m in case[1]):
            assert out == {"error": "TypeError"}, name  # 4.x renders the null (test below)
            continue
        assert _mine(case) == (out["ids"], out["mask"]), name
        assert sum(out["mask"]) > 0
    case, out = cases["mask/smollm3/0"]
    tok = load_tokenizer(case[0])
    learnt = tok.decode([i for i, m in zip(out["ids"], out["mask"], strict=True) if m])
    assert (
        learnt
        == "<|im_start|>assistant\nIt is 4.<|im_end|>\n<|im_start|>assistant\n9, of course.<|im_end|>\n"
    )


@pytest.mark.reference
def test_messages_read_as_transformers_5_reads_them(theirs):
    """transformers 5.x drops a message's null-valued keys (DeepSeek-R1/V3's template iterates a null
    tool_calls otherwise: a TypeError under 4.57) and passes ``reasoning`` as ``reasoning_content``
    (Qwen3's template renders it); meshkit renders as 5.x does."""
    five, cases = theirs
    for name in ("5.x/nulls", "5.x/reasoning"):
        case, out = cases[name]
        mine = _mine(case)[0]
        if five:
            assert mine == out["ids"], name
        elif name == "5.x/nulls":
            assert out == {"error": "TypeError"}
        else:
            assert mine != out["ids"]


@pytest.mark.reference
def test_a_llama_class_tokenizer_encodes_as_its_tokenizer_json(theirs):
    """The real OpenLLaMA tokenizer (class LlamaTokenizer) under Mistral 7B Instruct v0.1's template:
    meshkit's ids are its tokenizer.json's, SentencePiece's reading of each text between special tokens
    (a ``▁`` before ``[INST]`` after ``</s>``), what the model was trained on: transformers 4.57's
    AutoTokenizer and 5.x's PreTrainedTokenizerFast give them. 5.x's AutoTokenizer rebuilds the class
    around the vocabulary with ``legacy=False`` and drops that ``▁``: [2, 3081, ...] for [2, 836, ...]."""
    five, cases = theirs
    mine = _mine(cases["llama/auto"][0])[0]
    assert mine[:2] == [2, 836]
    assert mine == cases["llama/fast"][1]["ids"]
    auto = cases["llama/auto"][1]["ids"]
    assert (auto[:2] == [2, 3081] and auto != mine) if five else auto == mine


def _generation_template(out: Path) -> None:
    """The Gemma 2 fixture with transformers' {% generation %} tags around each answer and its end of turn."""
    shutil.copytree(TEMPLATES / "gemma2", out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ '<start_of_turn>model\n' }}{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}"
        "{% endgeneration %}{{ '\n' }}{% else %}{{ '<start_of_turn>' + message['role'] + '\n' + "
        "message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_masked_tokens_decode_to_the_assistant_turns(name):
    enc = _encoder(name)
    convo = TURNS if name == "gemma2" else [SYSTEM, *TURNS]
    ids, mask = enc.encode(read_row({"messages": convo}, "case"))
    assert len(ids) == len(mask) and set(np.unique(mask)) == {0, 1}
    answers = [m["content"] + END[name] for m in convo if m["role"] == "assistant"]
    assert enc.tokenizer.decode(ids[mask == 1]) == "".join(answers)
    # each run of learnt ids is one answer, ending at its end-of-turn id
    assert mask[0] == 0
    runs = np.split(ids, np.flatnonzero(np.diff(mask)) + 1)[1::2]
    assert [enc.tokenizer.decode(r) for r in runs] == answers


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_it():
    """Qwen3's template renders a final answer with an empty think block, an earlier one without: the
    assistant's tokens of a conversation's beginning are not those of the whole, so the mask is refused."""
    enc = _encoder("qwen3")
    with pytest.raises(DataError, match=r"qwen3.*rewrites earlier turns"):
        enc.encode_row({"messages": [SYSTEM, *TURNS]}, "chats.jsonl:3")
    ids, mask = enc.encode(read_row({"messages": [SYSTEM, *TURNS[:2]]}, "one turn"))
    assert enc.tokenizer.decode(ids[mask == 1]).endswith("It is 4.<|im_end|>")


def _learnt(enc: Encoder, row: dict) -> tuple[str, str]:
    """The row's whole text and its learnt text, decoded."""
    ids, mask = enc.encode(read_row(row, "case"))
    return enc.tokenizer.decode(ids), enc.tokenizer.decode(ids[mask == 1])


def test_an_end_of_turn_written_only_between_messages_is_learnt():
    """Qwen1.5's first template writes <|im_end|> after a message only when another follows: each answer
    ends with it where the render has it, and the row's last answer is given it as the conversation
    continued renders it (before: no answer's <|im_end|> was learnt, and the last one never written)."""
    enc = _encoder("qwen1_5")
    text, learnt = _learnt(enc, {"messages": TURNS})
    assert learnt == "It is 4.<|im_end|>9, of course.<|im_end|>"
    assert text.endswith("<|im_start|>assistant\n9, of course.<|im_end|>") and enc.added == {"<|im_end|>": 1}
    assert enc.template.render(TURNS) + "<|im_end|>" == text
    text, learnt = _learnt(enc, {"messages": TURNS[:3]})  # ends at a user turn: nothing added
    assert (
        learnt == "It is 4.<|im_end|>"
        and text == enc.template.render(TURNS[:3])
        and enc.added == {"<|im_end|>": 1}
    )


def test_a_template_without_an_end_of_turn_token_is_refused_in_one_line(tmp_path):
    """An answer that ends in no control token: learnt as it was, a model would never learn to stop, so
    meshkit says so: Synatra-Mixtral's template (no end of turn at all), and Qwen1.5's when the tokenizer's
    end of text is not the <|im_end|> it writes between messages (--eos-token names it)."""
    shutil.copytree(TEMPLATES / "llama3", tmp_path / "synatra")
    (tmp_path / "synatra" / "chat_template.jinja").write_text(
        (TEMPLATES / "src" / "synatra.jinja").read_text()
    )
    with pytest.raises(DataError, match=r"'chats.jsonl:4': chat template .*synatra.* ends assistant message 1 "
                       r"with no end-of-turn token .*\{% generation %\} tags") as e:  # fmt: skip
        _encoder_at(tmp_path / "synatra").encode_row({"messages": TURNS[:2]}, "chats.jsonl:4")
    assert "\n" not in str(e.value)
    other = Encoder(
        load_tokenizer(TEMPLATES / "qwen1_5", eos="<|endoftext|>"), load_template(TEMPLATES / "qwen1_5")
    )
    with pytest.raises(DataError, match=r"writes '<\|im_end\|>' after it only when another message follows; that "
                       r"is not the tokenizer's end-of-text token '<\|endoftext\|>'.*--eos-token <\|im_end\|>"):  # fmt: skip
        other.encode_row({"messages": TURNS}, "chats.jsonl:5")


def test_the_manifest_says_how_the_mask_was_found_and_what_was_added(tmp_path):
    """``meshkit data prepare --chat`` records the mask's source and the ends of turn it added, and its
    line says so."""
    from meshkit.data.prepare import prepare
    from meshkit.data.prepare_chat import summary

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (TURNS, TURNS[:2], TURNS[:3])))
    chat = prepare([str(src)], tmp_path / "q", tokenizer=str(TEMPLATES / "qwen1_5"), chat=True)
    assert chat["chat"]["mask"] == "rendered turns" and chat["chat"]["end_of_turn_added"] == {"<|im_end|>": 2}
    assert "2 conversation(s) end with '<|im_end|>' added after the last answer" in summary(chat)
    tagged = prepare([str(src)], tmp_path / "s", tokenizer=str(TEMPLATES / "smollm3"), chat=True)
    assert tagged["chat"]["mask"] == "generation tags" and "mask from its generation tags" in summary(tagged)


def _encoder_at(directory: Path) -> Encoder:
    return Encoder(load_tokenizer(directory), load_template(directory))


def test_generation_tags_are_the_mask():
    """SmolLM3's template marks each assistant turn, header and trailing newline included, with
    {% generation %}: that is the mask (before: the rendered turns', content and <|im_end|> only). In a
    prompt/completion row the prompt's tagged turns and the generation prompt are context."""
    enc = _encoder("smollm3")
    _, learnt = _learnt(enc, {"messages": [OVERRIDE, *TURNS]})
    assert (
        learnt
        == "<|im_start|>assistant\nIt is 4.<|im_end|>\n<|im_start|>assistant\n9, of course.<|im_end|>\n"
    )
    _, learnt = _learnt(enc, {"prompt": [OVERRIDE, *TURNS[:3]], "completion": TURNS[3:]})
    assert learnt == "9, of course.<|im_end|>\n"
    _, learnt = _learnt(_encoder("deepseek_training"), {"messages": TOOLS})  # tool calls, a null key
    assert learnt.startswith("<｜Assistant｜>Let me add.<｜tool▁calls▁begin｜>") and learnt.endswith(
        "<｜tool▁outputs▁end｜>It is 4.<｜end▁of▁sentence｜>"
    )


def test_null_keys_are_dropped_and_a_template_error_is_one_line():
    """DeepSeek-R1/V3's template iterates ``tool_calls`` wherever the key is: null there is dropped as
    transformers 5.x drops it (before: a TypeError traceback); a row the template still cannot render
    (its arguments a dict, which it adds to a string) is one line naming the row, the template and the error."""
    template = load_template(TEMPLATES / "deepseek")
    assert template.render(NULLS) == template.render(TURNS)
    with pytest.raises(DataError) as e:
        _encoder("deepseek").encode_row({"messages": TOOLS}, "chats.jsonl:9")
    said = str(e.value)
    assert said.startswith("'chats.jsonl:9': chat template '") and "deepseek" in said and "\n" not in said
    assert "fails on it (TypeError: can only concatenate str" in said


def test_lone_surrogates_are_refused_naming_the_row_and_field():
    """JSON's "\\ud800" reads as a lone UTF-16 surrogate, which no tokenizer encodes (before: a
    UnicodeEncodeError traceback from the tokenizer)."""
    row = {"messages": [TURNS[0], {"role": "assistant", "content": "bad \ud800 text"}]}
    with pytest.raises(DataError, match=r"'chats.jsonl:2': messages\[1\].content holds a lone UTF-16 surrogate "
                       r"\(\\ud800 at character 4\)") as e:  # fmt: skip
        _encoder("llama3").encode_row(row, "chats.jsonl:2")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"'r': completion holds a lone UTF-16 surrogate"):
        read_row({"prompt": "p", "completion": "\udfff"}, "r")


def test_prompt_completion_rows():
    enc = _encoder("llama3")
    ids, mask = enc.encode(read_row({"prompt": "Q: 2+2?", "completion": " A: 4"}, "r"))
    assert enc.tokenizer.decode(ids[mask == 1]) == " A: 4<|eot_id|>"
    assert enc.tokenizer.decode(ids) == "Q: 2+2? A: 4<|eot_id|>"
    prompt = [SYSTEM, TURNS[0]]
    ids, mask = enc.encode(read_row({"prompt": prompt, "completion": [TURNS[1]]}, "r"))
    whole_ids, _ = enc.encode(read_row({"messages": [*prompt, TURNS[1]]}, "r"))
    assert ids.tolist() == whole_ids.tolist()
    assert enc.tokenizer.decode(ids[mask == 1]) == "It is 4.<|eot_id|>"


def test_template_sources(tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's; a list of named templates gives 'default'."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "chat_template": [{"name": "tool_use", "template": "T"},
                                                           {"name": "default", "template": "{{ bos_token }}D"}]}))  # fmt: skip
    assert load_template(tmp_path).render(TURNS) == "<s>D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_template(tmp_path).render(TURNS) == "J4"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "x", "template": "T"}]})
    )
    with pytest.raises(DataError, match="no 'default'"):
        load_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataError, match="has no chat template"):
        load_template(tmp_path)


@pytest.mark.parametrize(
    ("row", "said"),
    [
        ({"text": "hi"}, "has neither 'messages'"),
        ({"messages": []}, "'messages' is empty"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "role 'bot', not one of system, user, assistant, tool",
        ),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] \(user\) has no 'content' string"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message to learn"),
        ({"prompt": "p", "completion": ""}, "'completion' is empty"),
        ({"messages": [SYSTEM, *TURNS]}, "System role not supported"),  # Gemma's template raises
    ],
)
def test_bad_rows_are_one_line_naming_the_row(row, said):
    with pytest.raises(DataError, match=said) as e:
        _encoder("gemma2").encode_row(row, "chats.jsonl:7")
    assert "'chats.jsonl:7'" in str(e.value) and "\n" not in str(e.value)


def test_rows_encoded_together_equal_each_alone():
    enc = _encoder("llama3")
    rows = [({"messages": [SYSTEM, *TURNS]}, "a"), ({"prompt": "x = ", "completion": "1"}, "b"),
            ({"prompt": [TURNS[0]], "completion": [TURNS[1]]}, "c")]  # fmt: skip
    together = enc.encode_rows(rows)
    for (row, where), (ids, mask) in zip(rows, together, strict=True):
        alone_ids, alone_mask = enc.encode_row(row, where)
        assert ids.tolist() == alone_ids.tolist() and mask.tolist() == alone_mask.tolist()
