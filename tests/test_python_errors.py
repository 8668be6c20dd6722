"""Issue 75, row 10: the Python face says what is wrong in Python's words: mmkv's own errors, named
mmkv.X, with keywords (not flags); a list of questions asked in turn; a closed pack refused."""

import pytest

import mmkv
from mmkv import methods
from tests.conftest import SAMPLES
from tests.helpers import encode_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory, backbones):
    path = tmp_path_factory.mktemp("py") / "p.kvpack"
    encode_pack(str(SAMPLES / "clip.mp4"), path, "demo", "full")
    return str(path)


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda p: methods.MuKV(budget="half"), "budget must be a number in (0, 1], got 'half'"),
        (lambda p: methods.MuKV(budget_tokens=2.5), "budget_tokens must be a whole number"),
        (lambda p: mmkv.ask(p, "what ?", at="2"), "at must be a finite number of seconds"),
        (lambda p: mmkv.ask(p, "what ?", max_new_tokens="9"), "max_new_tokens must be a whole"),
        (lambda p: mmkv.ask(p, "what ?", temperature=-1), "temperature must be a number >= 0"),
        (lambda p: mmkv.ask(p, "what ?", prune_budget=0.5), "prune_budget at ask only applies"),
        (lambda p: mmkv.ask(p, 3), "question must be text or a list of texts, not 3"),
    ],
)
def test_a_wrong_value_is_a_usage_error_in_pythons_words(pack, call, said):
    with pytest.raises(mmkv.UsageError) as raised:
        call(pack)
    assert said in str(raised.value) and "--" not in str(raised.value)
    assert f"{type(raised.value).__module__}.{type(raised.value).__name__}" == "mmkv.UsageError"


def test_a_list_of_questions_is_asked_in_turn_and_a_closed_pack_refused(pack):
    questions = ["what color is the circle ?", "which shape appeared first ?"]
    answers = mmkv.ask(pack, questions, max_new_tokens=2)
    assert [a.answer for a in answers] == [mmkv.ask(pack, q, max_new_tokens=2).answer
                                           for q in questions]  # fmt: skip
    opened = mmkv.open(pack)
    assert opened.ask(questions[0], max_new_tokens=2).answer == answers[0].answer
    opened.close()
    with pytest.raises(mmkv.UsageError, match="is closed: open it again"):
        opened.ask(questions[0])
