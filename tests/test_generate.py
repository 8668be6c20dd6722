"""Generation apart from the cache: greedy and sampled token choice, stop strings, and a text stream
that never shows half a character."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mmkv_cli.ask.generate import TextStream, generate, pick
from mmkv_cli.core.options import GenerationOptions


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer with one token per byte: '红' (3 UTF-8 bytes) is three tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_a_character_split_across_tokens_is_never_shown_broken():
    tok = byte_tokenizer()
    ids = tok.encode("红色 ok").ids
    assert len(ids) == 9  # two 3-byte characters, a space, two letters
    assert "\ufffd" in tok.decode(ids[:1])  # what a naive streamer would print
    stream = TextStream(lambda t: tok.decode(t))
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.finish() == "红色 ok"
    assert pieces[:3] == ["", "", "红"]


def test_a_stop_string_ends_the_answer_before_it_even_across_tokens():
    tok = byte_tokenizer()
    stream = TextStream(lambda t: tok.decode(t), stop=("END",))
    shown = "".join(
        stream.push(i) for i in tok.encode("red ENthen END more").ids if not stream.stopped
    )
    assert stream.stopped and shown + stream.finish() == "red ENthen "


def fixed_model(vocab: int = 8):
    """Logits that favour token (last + 1) % vocab, so greedy decoding counts up."""

    def step(token: int) -> torch.Tensor:
        logits = torch.zeros(vocab)
        logits[(token + 1) % vocab] = 4.0
        return logits

    return step


def test_greedy_decoding_follows_the_argmax_and_stops_at_an_end_token_or_the_limit():
    step = fixed_model()
    spelled = lambda ids: " ".join(map(str, ids))  # noqa: E731
    made = generate(step(0), step, spelled, {5}, GenerationOptions(max_new_tokens=10))
    assert made.token_ids == [1, 2, 3, 4] and made.text == "1 2 3 4"
    short = generate(step(0), step, spelled, set(), GenerationOptions(max_new_tokens=3))
    assert short.token_ids == [1, 2, 3]


def test_sampling_is_reproducible_with_a_seed_and_top_p_cuts_the_tail():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    options = GenerationOptions(temperature=1.0, seed=7)
    draws = [pick(logits, options, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    spread = {pick(logits, options, torch.Generator().manual_seed(s)) for s in range(200)}
    assert spread == {0, 1, 2, 3}
    nucleus = GenerationOptions(temperature=1.0, top_p=0.6)
    kept = {pick(logits, nucleus, torch.Generator().manual_seed(s)) for s in range(200)}
    assert kept == {0, 1}  # the two head tokens hold more than 0.6 of the mass together
    assert pick(logits, GenerationOptions(), None) == 0


def test_no_token_is_picked_from_non_finite_logits():
    import pytest

    from mmkv_cli.ask.generate import pick
    from mmkv_cli.core.errors import ModelError
    from mmkv_cli.core.options import GenerationOptions

    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(10)
        logits[3] = bad
        for temperature in (0.0, 1.0):
            with pytest.raises(ModelError, match="not finite"):
                pick(logits, GenerationOptions(temperature=temperature), None)


def test_a_context_verdict_left_unread_is_read_with_the_first_token():
    """A quantized context decoded on the device leaves its NaN/Inf verdict for the first token:
    a bad one refuses the pack before any text is shown, whatever the temperature; a good one costs
    the answer nothing, and is read once."""
    import pytest

    from mmkv_cli.core.errors import PackError
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts, finite_flag

    logits = torch.zeros(10)
    logits[4] = 1.0
    shown = []
    for temperature in (0.0, 1.0):
        later = LaterVerdicts("p.kvpack")
        later.add(finite_flag([torch.ones(3), torch.tensor([0.0, float("inf")])]), ["b0", "b1"])
        later.add(finite_flag([torch.arange(3)]), ["b2"])  # integers: nothing to check
        with pytest.raises(PackError, match=r"p.kvpack is corrupted \(NaN or Inf in the K/V of b0"):
            generate(logits, lambda t: logits, str, set(), GenerationOptions(4, temperature),
                     shown.append, later=later)  # fmt: skip
        assert shown == []
    later = LaterVerdicts("p.kvpack")
    later.add(finite_flag([torch.ones(3)]), ["b0"])
    steps = []
    made = generate(logits, lambda t: steps.append(t) or logits, str, set(),
                    GenerationOptions(3), later=later)  # fmt: skip
    assert made.token_ids == [4, 4, 4] and later.pending() is None


def test_no_token_is_shown_before_the_contexts_checksums_are_read():
    """A read that left its checksums to finish (pack/integrity/verdicts.py) refuses the pack
    before the first token, and with no token to make at all."""
    from mmkv_cli.core.errors import PackError
    from mmkv_cli.pack.integrity.verdicts import LaterVerdicts

    def refused() -> None:
        raise PackError("p.kvpack is corrupted (checksum mismatch in b1)")

    shown: list[str] = []
    for tokens in (4, 0):
        later = LaterVerdicts("p.kvpack")
        later.defer(refused)
        options = GenerationOptions(max_new_tokens=tokens)  # 0: the verdict is still read
        with pytest.raises(PackError, match="checksum mismatch in b1"):
            generate(torch.tensor([0.0, 5.0, 1.0]), lambda t: torch.tensor([9.0, 0.0, 0.0]),
                     str, set(), options, shown.append, later=later)  # fmt: skip
    assert shown == []
