"""``reward_model`` reward: a Hugging Face sequence-classification model scores prompt + completion, as in TRL.

What TRL 1.16's ``GRPOTrainer`` does with a model among its ``reward_funcs`` (``_calculate_rewards``), done
here the same way:

- the text: for a line of chat ``messages``, the conversation with the completion as the assistant's turn,
  rendered by the reward model's own tokenizer (``apply_chat_template(messages, tokenize=False)``); for a
  text prompt, the prompt and the completion joined. (TRL also passes its ``chat_template_kwargs``; a
  scoring request carries none, so none are passed.)
- the tokens: the tokenizer's, no special tokens added, padded on the right; a tokenizer without a pad
  token pads with its EOS token, and the model's ``pad_token_id`` is set to it (a sequence classifier
  reads the last token that is not padding);
- the reward: ``logits[:, 0]``, the model in eval mode, without gradients.

Who runs it: a worker process of its own (one spawned ``pebble.ProcessPool`` worker), which loads each
model the operator lists in ``TANDEM_REWARD_MODELS`` once, on first use, onto ``model_device``, and
scores in batches of ``model_batch_size``; or a :data:`ModelRunner` elsewhere (on Modal, a container of
its own with a GPU if asked, started from a memory snapshot of the loaded models: ``deploy.modal_app``). A prompt set only names a model: a name the setting does not
list is refused before anything is scored (a 422 naming the field). A call past ``model_timeout_s``
kills the worker (the next call starts another, which loads again) and its completions get
``reward_error``, as do a prompt + completion longer than ``model_max_tokens`` and a logit that is not
finite: infrastructure statuses, so the group is retried and then dropped, never trained with a made-up 0.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from pebble import ProcessExpired, ProcessPool

from reward_server.verifiers.result import infra, scored
from services.reward_specs import RewardModelSpec
from services.wire import ScoreResult

_LOADED: dict[tuple[str, str], tuple] = {}
"""In the worker: (folder, device) -> (tokenizer, model), loaded once."""

ModelRunner = Callable[[str, list[tuple[str | list[dict], str]], int, int], Awaitable[list[float | str]]]
"""``runner(folder, pairs, batch_size, max_tokens)``: :func:`rewards` for the model in ``folder`` somewhere
other than this server's worker, on the device it has; cancelling it stops the call."""


def _load(path: str, device: str) -> tuple:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if (path, device) not in _LOADED:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(device).eval()
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        _LOADED[(path, device)] = tokenizer, model
    return _LOADED[(path, device)]


def move_loaded(device: str) -> None:
    """In the worker: every model loaded on the CPU, on ``device`` as well (Modal: the models loaded into the
    memory snapshot, then moved to the GPU the restored container has)."""
    for (path, where), (tokenizer, model) in list(_LOADED.items()):
        if where == "cpu" and (path, device) not in _LOADED:
            _LOADED[(path, device)] = tokenizer, model.to(device)


def rewards(path: str, device: str, batch_size: int, max_tokens: int,
            pairs: list[tuple[str | list[dict], str]]) -> list[float | str]:
    """In the worker: the model at ``path``'s reward for each ``(prompt or messages, completion)``, or why
    there is none (a string)."""
    import torch

    tokenizer, model = _load(path, device)
    texts = [tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": completion}], tokenize=False)
             if isinstance(prompt, list) else prompt + completion for prompt, completion in pairs]
    out: list[float | str] = [""] * len(texts)
    fits = []
    for i, ids in enumerate(tokenizer(texts, add_special_tokens=False)["input_ids"]):
        if len(ids) > max_tokens:
            out[i] = f"prompt + completion is {len(ids)} tokens, over model_max_tokens ({max_tokens})"
        else:
            fits.append(i)
    for start in range(0, len(fits), batch_size):
        batch = fits[start:start + batch_size]
        inputs = tokenizer(text=[texts[i] for i in batch], return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False).to(device)
        with torch.inference_mode():
            logits = model(**inputs).logits[:, 0].float().tolist()
        for i, value in zip(batch, logits, strict=True):
            out[i] = value if math.isfinite(value) else f"the model's logit is {value}"
    return out


@dataclass(frozen=True)
class ModelLeaf:
    """One ``reward_model`` spec to score: ``where`` is its field path (``items.3.spec.parts.1.spec``)."""

    where: str
    item_id: str
    prompt: str | list[dict]
    """The prompt text, or the chat messages (rendered with the reward model's chat template)."""
    completion: str
    spec: RewardModelSpec


class RewardModels:
    """The reward models this server may load (name -> folder) and the worker that runs them."""

    def __init__(self, models: dict[str, Path], *, device: str = "cpu", batch_size: int = 32,
                 max_tokens: int = 4096, timeout_s: float = 120.0, runner: ModelRunner | None = None) -> None:
        self.models = {name: str(path) for name, path in models.items()}
        self.device, self.batch_size, self.max_tokens, self.timeout_s = device, batch_size, max_tokens, timeout_s
        self._runner = runner
        self._pool = (ProcessPool(max_workers=1, context=mp.get_context("spawn"))
                      if models and runner is None else None)

    def refusal(self, name: str) -> str | None:
        """Why ``name`` cannot be scored with; None if the server lists it."""
        if name in self.models:
            return None
        listed = ", ".join(sorted(self.models)) or "none: the setting is empty"
        return f"{name} is not a reward model of this reward server's TANDEM_REWARD_MODELS (listed: {listed})"

    async def score(self, leaves: list[ModelLeaf]) -> dict[str, ScoreResult]:
        """Every leaf's result by its ``where``: one call of the worker per model. Every leaf's model is listed
        (:meth:`refusal`)."""
        by_model: dict[str, list[ModelLeaf]] = {}
        for leaf in leaves:
            by_model.setdefault(leaf.spec.model, []).append(leaf)
        done: dict[str, ScoreResult] = {}
        for name, group in by_model.items():  # one worker: the calls would queue anyway
            try:
                values = await self._run(self.models[name], [(leaf.prompt, leaf.completion) for leaf in group])
            except TimeoutError:
                values = [f"scoring {len(group)} completions took over {self.timeout_s:g} s (model_timeout_s)"] * len(group)
            except ProcessExpired as e:
                values = [f"the worker died (exit code {e.exitcode})"] * len(group)
            except Exception as e:  # noqa: BLE001 - a model that cannot load or run: its completions say why
                values = [f"{type(e).__name__}: {e}"] * len(group)
            for leaf, value in zip(group, values, strict=True):
                done[leaf.where] = (scored(leaf.item_id, value, "ok", f"reward model {name}")
                                    if isinstance(value, float) else
                                    infra(leaf.item_id, "reward_error", f"reward model {name}: {value}"))
        return done

    async def _run(self, path: str, pairs: list[tuple[str | list[dict], str]]) -> list[float | str]:
        if self._runner is not None:
            return await asyncio.wait_for(self._runner(path, pairs, self.batch_size, self.max_tokens), self.timeout_s)
        assert self._pool is not None  # only listed models get here, and a list makes a pool
        future = self._pool.schedule(rewards, (path, self.device, self.batch_size, self.max_tokens, pairs),
                                     timeout=self.timeout_s)
        return await asyncio.wrap_future(future)

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            await asyncio.to_thread(self._pool.join)
