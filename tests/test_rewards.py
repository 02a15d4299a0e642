"""GRPO's rewards (``meshkit.rewards``): ``exact`` (the stripped text is the answer, or for a number the
completion's last number equals it), ``regex:PATTERN`` (re.search; the rest of the spec, commas and all),
a user's function by ``file.py:name`` or ``module:name`` called TRL's way (prompts, completions, each
column a list over the batch), several summed with a None adding nothing; a function that raises or
returns what is no reward per completion is one line naming it and the completion."""

import sys
import textwrap

import numpy as np
import pytest

from meshkit.rewards import Reward, RewardError, exact, last_number, load

USER = [{"role": "user", "content": "What is 2+3?"}]


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("  42\n", "42", 1.0),  # the text, stripped
        ("Paris", " Paris ", 1.0),
        ("paris", "Paris", 0.0),
        ("The answer is 42.", 42, 1.0),  # a number: the completion's last number
        ("The answer is 42.", "42", 1.0),  # text that reads as a number is one
        ("42 or maybe 41", 42, 0.0),  # the last number, not any
        ("so x = 72.0", "72", 1.0),  # compared as decimals
        ("total: $1,234", 1234, 1.0),  # thousands grouped by commas
        ("it is 1,2,34", 1234, 0.0),  # not a grouping: 1, 2 and 34
        ("a drop of -3", -3, 1.0),
        ("from 5-3", -3, 0.0),  # a minus after a digit is no sign: 3
        ("0.5", 0.5, 1.0),
        ("True", True, 1.0),  # a bool is no number: its text
        ("1", True, 0.0),
        ("no number", 3, 0.0),
        (
            "#### 18",
            "Janet sells 16 - 3 - 4 = 9 eggs... #### 18",
            0.0,
        ),  # an answer that is no number: text only
    ],
)
def test_exact_is_the_stripped_text_or_for_a_number_the_last_number(completion, answer, reward):
    assert exact([completion], [answer]) == [reward]
    assert load("exact")(["q"], [completion], [{"answer": answer}]).tolist() == [reward]


def test_last_number_reads_signs_groupings_and_fractions():
    assert [str(last_number(t)) for t in ("a 3.25 b", "-7", "x-7", "(2)-7", "10,000 and 12,5")] == [
        "3.25",
        "-7",
        "7",
        "7",
        "5",
    ]
    assert last_number("none") is None


def test_regex_searches_the_completion_and_takes_the_rest_of_the_spec_commas_and_all():
    r = load("exact, regex:^<think>.*</think>\\s*\\d{1,3},?$")
    assert r.names == ("exact", "regex:^<think>.*</think>\\s*\\d{1,3},?$")
    got = r(["q"] * 3, ["<think>hm</think> 5", "<think>a\nb</think> 5,", "5"], [{"answer": "5"}] * 3)
    # exact (the last number is 5) and the regex (no DOTALL: write (?s) for it)
    assert got.dtype == np.float64 and got.tolist() == [1.0 + 1.0, 1.0 + 0.0, 1.0 + 0.0]
    assert load("regex:(?s)<think>.*</think>")(["q"], ["<think>a\nb</think>"], [{}]).tolist() == [1.0]


FUNCTIONS = textwrap.dedent(
    """
    SEEN = []

    def length(prompts, completions, answer, level, **kwargs):
        SEEN.append({"prompts": prompts, "completions": completions, "answer": answer, "level": level, **kwargs})
        return [None if v is None else float(len(str(c))) for c, v in zip(completions, level)]

    def raises(prompts, completions, answer, **kwargs):
        return [1.0 / int(a) for a in answer]

    def batch_only(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("a batch is too long")
        return [0.0]

    def short(prompts, completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    def text(prompts, completions, **kwargs):
        return [1.0, "high", 0.0]

    def nan(prompts, completions, **kwargs):
        return [0.0, 1.0, float("nan")]

    def inf(prompts, completions, **kwargs):
        return (0.0, float("-inf"), 1.0)

    def scalar(prompts, completions, **kwargs):
        return 1.0

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def functions(tmp_path, monkeypatch):
    """The functions' file; the module it is loaded as is forgotten after the test."""
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS, encoding="utf-8")
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    yield path
    sys.modules.pop("my_rewards", None)


def test_a_users_function_is_called_trls_way_and_the_rewards_are_summed(functions):
    r = load(f"exact,{functions}:length")
    assert isinstance(r, Reward) and r.names == ("exact", f"{functions}:length")
    prompts = ["What is 1+1?", USER, USER]
    rows = [
        {"answer": "2", "level": 1},
        {"answer": 5, "level": 2, "source": "gsm"},
        {"answer": "7", "level": None},
    ]
    got = r(prompts, ["2", "It is 5", "6"], rows, completion_ids=[[1], [2, 3], [4]])
    message = [{"role": "assistant", "content": "It is 5"}]
    # exact: 1, 1 (the last number), 0; length: 1, TRL's message's, None (it does not apply: adds nothing)
    assert got.tolist() == [1.0 + 1.0, 1.0 + len(str(message)), 0.0]
    assert np.isnan(r.scores(prompts, ["2", "It is 5", "6"], rows)[2, 1])
    call = r.terms[1].fn.__globals__["SEEN"][0]
    assert call["prompts"] == prompts and call["answer"] == ["2", 5, "7"] and call["level"] == [1, 2, None]
    assert call["completions"][0] == "2"  # a string prompt's completion is its text
    assert call["completions"][1] == message  # a conversation's completion: TRL's assistant message
    assert call["source"] == [None, "gsm", None]  # every row's columns, None where a row has none
    assert call["completion_ids"] == [[1], [2, 3], [4]] and "prompt" not in call


def test_a_users_function_by_module_name(functions, monkeypatch):
    monkeypatch.syspath_prepend(str(functions.parent))
    r = load("my_rewards:length, exact")
    assert r(["q"], ["abc"], [{"answer": "abc", "level": 0}]).tolist() == [4.0]


BAD = [
    (
        "raises",
        r"reward 'F:raises' raised ZeroDivisionError: float division by zero \(first alone at completion 1\)",
    ),
    ("batch_only", r"reward 'F:batch_only' raised ValueError: a batch is too long$"),
    ("short", r"reward 'F:short' returned 2 rewards for 3 completions: return one per completion"),
    ("text", r"reward 'F:text' returned 'high' \(a str\) for completion 1: return a float, or None where"),
    (
        "nan",
        r"reward 'F:nan' returned nan for completion 2: return a finite float, or None where it does not",
    ),
    ("inf", r"reward 'F:inf' returned -inf for completion 1: return a finite float"),
    ("scalar", r"reward 'F:scalar' returned a float, not a list of 3 rewards: return a float \(or None"),
]


@pytest.mark.parametrize(("name", "said"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_function_is_one_line_naming_it_and_the_completion(functions, name, said):
    r = load(f"exact,{functions}:{name}")
    with pytest.raises(RewardError, match=said.replace("F", str(functions))) as e:
        r(["q"] * 3, ["1", "2", "3"], [{"answer": "1"}, {"answer": "0"}, {"answer": "3"}])
    assert "\n" not in str(e.value)


def test_a_reward_that_cannot_be_loaded_is_one_line(functions, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no such thing')\n")
    cases = [
        ("foo", r"unknown reward 'foo' in --reward 'foo': give exact, regex:PATTERN, or a function"),
        ("exact,", None),  # a trailing comma names nothing more
        (" ", r"--reward ' ' names no reward"),
        ("regex:", r"reward 'regex:' has no pattern: give regex:PATTERN"),
        ("regex:(a", r"reward 'regex:\(a' is no regular expression \(missing \), .*\): fix the pattern"),
        (f"{tmp_path}/none.py:f", r"reward '.*none.py:f': no file '.*none.py': give module:function"),
        (
            f"{functions}:nope",
            r"reward '.*:nope': module '.*' has no attribute 'nope': check the function name",
        ),
        (
            f"{functions}:NOT_A_FUNCTION",
            r"reward '.*:NOT_A_FUNCTION' is a int, not a function: name a function",
        ),
        (f"{broken}:f", r"loading reward '.*broken.py:f' raised ImportError: no such thing"),
    ]
    for spec, said in cases:
        if said is None:
            assert load(spec).names == ("exact",)
            continue
        with pytest.raises(RewardError, match=said) as e:
            load(spec)
        assert "\n" not in str(e.value)


def test_exact_needs_an_answer_and_a_batch_needs_a_row_per_completion():
    with pytest.raises(
        RewardError, match=r"reward 'exact' needs each row's 'answer', and completion 1's row has none"
    ):
        load("exact")(["q", "q"], ["1", "2"], [{"answer": 1}, {"question": "q"}])
    with pytest.raises(
        RewardError, match=r"a reward is given 1 prompts, 2 completions and 2 rows: give one of each"
    ):
        load("exact")(["q"], ["1", "2"], [{"answer": 1}] * 2)
