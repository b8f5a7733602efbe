"""examples/tiny.py's character tokenizer: what a tool's answer or a prompt line may hold never makes it raise."""

from __future__ import annotations

from examples.tiny import char_tokenizer


def test_unknown_characters_are_dropped_and_known_ones_keep_their_ids():
    tok = char_tokenizer(alphabet="0123456789+=<>/ ")
    known = tok.encode("12+3=", add_special_tokens=False)
    # an episode's observation may hold anything a sandboxed program printed: letters, é, NUL, a newline
    assert tok.encode("1é2\x00+Z3\n=", add_special_tokens=False) == known
    assert tok.decode(known) == "12+3="
    assert tok.encode("éZ", add_special_tokens=False) == []
    assert tok.encode("<eos>", add_special_tokens=False) == [tok.eos_token_id]  # special tokens are kept whole
