"""Chat templates (issue 37): three families' real templates rendered and tokenised as transformers'
``apply_chat_template`` does (``-m reference``: against transformers 4.57 and 5.x), the assistant-only
loss mask, prompt/completion rows, and bad rows refused in one line naming the row and the fix."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

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


_REFERENCE = """
import json, sys
from transformers import AutoTokenizer
out = []
for d, messages, gen, masks in json.loads(sys.stdin.read()):
    tok = AutoTokenizer.from_pretrained(d)
    got = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True,
                                  return_assistant_tokens_mask=masks)
    out.append([list(map(int, got["input_ids"])), list(map(int, got.get("assistant_masks") or []))])
print(json.dumps(out))
"""


def _reference(python: str, cases: list) -> list:
    run = subprocess.run([python, "-c", _REFERENCE], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.reference
def test_ids_equal_transformers_apply_chat_template(reference_python, tmp_path):
    """Token ids of three families' real templates (Llama 3.3, Qwen3, Gemma 2) equal transformers'
    apply_chat_template(tokenize=True); and on a template with {% generation %} tags, meshkit's
    assistant mask (found by rendering prefixes) equals transformers' assistant_masks."""
    cases = [(str(TEMPLATES / n), m, g, False) for n, m, g in _cases()]
    tagged = tmp_path / "gemma2-generation"
    _generation_template(tagged)
    cases += [(str(tagged), TURNS, False, True), (str(tagged), TURNS[:2], False, True)]
    theirs = _reference(reference_python, cases)
    for (d, messages, generation, masks), (ids, assistant) in zip(cases, theirs, strict=True):
        enc = Encoder(load_tokenizer(d), load_template(d))
        assert _ids(enc, messages, generation) == ids, (d, generation)
        if masks:
            mine_ids, mine_mask = enc.encode(read_row({"messages": messages}, "case"))
            assert mine_ids.tolist() == ids and mine_mask.tolist() == assistant, d
            assert sum(assistant) > 0


def _generation_template(out: Path) -> None:
    """The Gemma 2 fixture with transformers' {% generation %} tags around each answer and its end of turn."""
    import shutil

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
