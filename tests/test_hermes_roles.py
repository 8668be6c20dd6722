"""HERMES scores each layer role by its own pseudo-question, as the authors' code asks them:
middle layers by the local and global ones joined, deep layers by the global one, shallow layers by
recency alone; a live stream's last turn before both when asked for (issue 51)."""

from dataclasses import replace

import torch

from mmkv_cli.methods import Budget, EncodeContext
from mmkv_cli.methods.hermes import HermesMemory, HermesParams
from mmkv_cli.methods.hermes_scoring import layer_roles, role_questions


class Asked:
    """A stream state whose `attend` answers each prompt with its own per-layer tensors and
    records what it was asked."""

    def __init__(self, layers: int, tokens: int):
        self.layers, self.tokens, self.prompts = layers, tokens, []
        self.cache = type("Cache", (), {"count": lambda _, layer: tokens})()

    def attend(self, prompt):
        if isinstance(prompt, list):  # several questions: asked in one call, one wait
            self.calls = getattr(self, "calls", 0) + 1
            return [self.attend(p) for p in prompt]
        self.prompts.append(prompt)
        seed = len(self.prompts)
        return [torch.full((self.tokens,), float(seed * 100 + n)) for n in range(self.layers)]


def test_role_questions_follow_the_codes_join_and_turn():
    asked = role_questions("L.", "G.")
    assert asked == {"shallow": "L.", "middle": "L.; G.", "deep": "G."}
    turned = role_questions("L.", "G.", ("what color ?", "red"))
    assert turned["deep"].endswith("G.") and "Question: what color ? Answer: red" in turned["deep"]
    assert turned["middle"] == f"{turned['shallow']}; {turned['deep']}"


def test_each_layer_is_scored_by_its_roles_question_and_shallow_ones_ask_none():
    params = HermesParams()
    state = Asked(layers=10, tokens=5)
    roles = layer_roles(10, params.shallow_share, params.deep_share)
    attention = HermesMemory(params, Budget(tokens=4), EncodeContext())._attention(state, roles)
    questions = role_questions(params.local_question, params.global_question)
    assert state.prompts == [questions["deep"], questions["middle"]]  # two forwards, not three
    assert state.calls == 1  # in one call: their scores reach the host in one copy
    for layer, (role, _) in enumerate(roles):
        want = {"shallow": 1.0, "deep": 100.0 + layer, "middle": 200.0 + layer}[role]
        assert attention[layer].tolist() == [want] * 5, (layer, role)


def test_one_prompt_or_a_given_guidance_prompt_scores_every_layer():
    roles = layer_roles(10, 0.1, 0.3)
    for params, context in (
        (HermesParams(prompts="one"), EncodeContext()),
        (HermesParams(), EncodeContext(guidance_prompt="where is the cup ?")),
        (HermesParams(guidance_prompt="where is the cup ?"), EncodeContext()),
    ):
        state = Asked(layers=10, tokens=3)
        HermesMemory(params, Budget(tokens=2), context)._attention(state, roles)
        assert len(state.prompts) == 1
        assert state.prompts[0] == context.guidance(params.guidance_prompt)


def test_the_last_turn_steers_the_questions_only_when_asked_to():
    roles = layer_roles(10, 0.1, 0.3)
    context = EncodeContext(turns=[("which shape ?", "circle"), ("what color ?", "red")])
    for params, shown in ((HermesParams(), False), (HermesParams(previous_turn=True), True)):
        state = Asked(layers=10, tokens=3)
        HermesMemory(params, Budget(tokens=2), context)._attention(state, roles)
        assert all(("what color ? Answer: red" in p) == shown for p in state.prompts)
        assert not any("which shape" in p for p in state.prompts)  # the last turn only
    assert replace(context, media_kind="pdf") == EncodeContext("pdf")  # turns are not identity


def test_a_live_follow_hands_each_answered_turn_to_the_memory(tmp_path, clip):
    import shutil

    import mmkv

    source = tmp_path / "clip.mp4"
    shutil.copy(clip, source)
    hermes = mmkv.methods.HERMES(budget_tokens=24, previous_turn=True)
    following = mmkv.live(
        str(source), tmp_path / "l.kvpack", model="demo", method=hermes, stall=0.5,
        questions=[("what color is the circle ?", 1.0)], max_new_tokens=4,
    )  # fmt: skip
    answers = list(following)
    assert following.wait().stopped == "ended" and answers[0].answer
    assert following.follow.context.turns == [("what color is the circle ?", answers[0].answer)]
