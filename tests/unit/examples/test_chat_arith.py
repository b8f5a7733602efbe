"""The chat example's pieces (examples/chat_arith/): its dataset, its tokenizer and chat template, its reward.

The whole walk-through, on the real stack, is tests/e2e/test_chat_arith.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "chat_arith"


@pytest.fixture(scope="module")
def reward():
    """The reward function as the reward server imports it: from the example folder on ``sys.path``."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import arith_reward
    finally:
        sys.path.remove(str(EXAMPLE))
    return arith_reward.reward


def _chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_the_reward_scores_completions_as_trl_passes_them(reward):
    prompts = [[{"role": "user", "content": "65+61="}]] * 5
    completions = [_chat("<answer>126</answer>"), _chat("<answer>116</answer>"), _chat("126"),
                   _chat("<answer> 126 </answer> and more"), "<answer>126</answer>"]  # the last: a prompt line's text
    assert reward(prompts, completions, solution=["126"] * 5, trainer_state=None) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert reward(prompts[:2], completions[:2], solution=["116", "126"]) == [0.0, 0.0]
    with pytest.raises(ValueError):  # one solution per completion, as TRL passes a column
        reward(prompts, completions, solution=["126"])


def test_the_dataset_is_arith_split_as_chat_rows(tmp_path):
    import pyarrow.parquet as pq

    from examples.arith.bootstrap import has_carry
    from examples.arith.make_data import build
    from examples.chat_arith.make_data import write

    train_path, eval_path = write(tmp_path)
    train, held_out = (pq.read_table(p).to_pylist() for p in (train_path, eval_path))
    arith_train, arith_held_out = build()
    assert [r["conversation"][-1]["content"] for r in train] == [line["prompt"] for line in arith_train]
    assert [r["solution"] for r in held_out] == [line["answer"] for line in arith_held_out]
    assert all(r["conversation"] == [{"role": "user", "content": r["conversation"][0]["content"]}] for r in train)
    assert all(r["carry"] == has_carry(r["conversation"][0]["content"]) for r in train + held_out)
    questions = {r["conversation"][0]["content"] for r in train}
    assert not questions & {r["conversation"][0]["content"] for r in held_out}
    assert write(tmp_path / "again")[0].read_bytes() == train_path.read_bytes()  # the same bytes: the cache key holds


def test_the_chat_tokenizer_keeps_the_arith_ids_and_writes_every_character_of_a_chat():
    from examples.arith.bootstrap import ALPHABET
    from examples.chat_arith.bootstrap import chat_tokenizer, render
    from examples.tiny import char_tokenizer

    arith, chat = char_tokenizer(ALPHABET).get_vocab(), chat_tokenizer().get_vocab()
    assert {t: chat[t] for t in arith} == arith and len(chat) > len(arith)
    assert sorted(chat.values()) == list(range(len(chat)))
    tok = chat_tokenizer()
    conversation = [{"role": "system", "content": "answer"}, {"role": "user", "content": "65+61="},
                    {"role": "assistant", "content": "<answer>126</answer>"}, {"role": "user", "content": "9+9="}]
    text = render(tok, conversation)
    assert text == "s:answer\nu:65+61=\na:<answer>126</answer>\nu:9+9=\na:"
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character, none dropped


def test_char_tokenizer_puts_extra_characters_after_the_alphabet_in_order():
    from examples.tiny import SPECIAL, char_tokenizer

    vocab = char_tokenizer("ba", extra="zab\ny").get_vocab()
    assert vocab == {**{t: i for i, t in enumerate(SPECIAL)}, "a": 3, "b": 4, "z": 5, "\n": 6, "y": 7}
