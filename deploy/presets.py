"""Architecture facts of the six base models tandem plans for.

Pure data: the memory planner (``deploy/plan.py``) and the CLI read these;
nothing here imports torch or transformers, and nothing downloads a config.

Sources: torchtitan's Qwen3 configs (https://github.com/pytorch/torchtitan,
``torchtitan/models/qwen3/``), the Qwen3 technical report
(https://arxiv.org/abs/2505.09388), the Qwen3-4B-Base model card
(https://huggingface.co/Qwen/Qwen3-4B-Base) and OLMo-core's transformer configs
(https://github.com/allenai/OLMo-core, ``src/olmo_core/nn/transformer/config.py``).
No *Base* model's ``config.json`` on the Hugging Face hub was read (nothing is
downloaded here), so the facts none of those sources states outright are
unverified; each preset lists them in ``unverified``, and the planner's figures
inherit that uncertainty:

- Qwen3-4B-Base: none (parameters from the model card).
- Qwen3-8B-Base, Qwen3-14B-Base: the parameter count (instruct model card /
  report), the maximum context.
- Qwen3-30B-A3B-Base: the total/active parameter counts, the context, tied
  embeddings (taken as untied, like the other Qwen3 models of its size).
- OLMo-3-1025-7B: the parameter count (~7B by its name; 7.3B is what its
  dimensions give), the intermediate size (derived), head dim (derived), the
  vocabulary, the context (secondary sources), tied embeddings (believed no).
- OLMo-3-1125-32B: the parameter count (~32B; 32.2B from its dimensions),
  head dim (derived), the vocabulary, the context, tied embeddings.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelPreset(BaseModel):
    """One base model's shape, enough to size its memory.

    Invariants: ``active_params <= params``; ``heads`` is a multiple of
    ``kv_heads``; ``experts_per_token <= experts`` (both 0 for a dense model).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The Hugging Face repository name, e.g. ``Qwen/Qwen3-8B-Base``."""
    params: float = Field(gt=0)
    """Total parameters, embeddings included."""
    active_params: float = Field(gt=0)
    """Parameters used per token (equal to ``params`` for a dense model)."""
    layers: int = Field(gt=0)
    """Transformer blocks."""
    hidden: int = Field(gt=0)
    """Residual stream width."""
    intermediate: int = Field(gt=0)
    """MLP inner width (per expert for an MoE model)."""
    heads: int = Field(gt=0)
    """Query heads."""
    kv_heads: int = Field(gt=0)
    """Key/value heads (grouped-query attention when below ``heads``)."""
    head_dim: int = Field(gt=0)
    """Width of one attention head."""
    experts: int = Field(default=0, ge=0)
    """Routed experts per MoE layer (0: dense)."""
    experts_per_token: int = Field(default=0, ge=0)
    """Experts each token is routed to (0: dense)."""
    vocab: int = Field(gt=0)
    """Embedding rows (the padded vocabulary, not the tokenizer's)."""
    context: int = Field(gt=0)
    """Maximum context length in tokens."""
    tied_embeddings: bool
    """Whether the output head shares the input embedding matrix."""
    unverified: tuple[str, ...] = ()
    """Fields no source above states for this model: taken from a secondary source, or derived from the others."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelPreset:
        if self.active_params > self.params:
            raise ValueError(f"{self.name}: active_params exceeds params")
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads})")
        if self.experts_per_token > self.experts:
            raise ValueError(f"{self.name}: experts_per_token exceeds experts")
        return self

    @property
    def embedding_params(self) -> float:
        """Input embedding plus output head (counted once when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def short_name(self) -> str:
        return self.name.split("/")[-1]


PRESETS: dict[str, ModelPreset] = {
    p.short_name.lower(): p
    for p in (
        ModelPreset(
            name="Qwen/Qwen3-4B-Base", params=4.0e9, active_params=4.0e9, layers=36, hidden=2560,
            intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936, context=32768,
            tied_embeddings=True,
        ),
        ModelPreset(
            name="Qwen/Qwen3-8B-Base", params=8.2e9, active_params=8.2e9, layers=36, hidden=4096,
            intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936, context=32768,
            tied_embeddings=False, unverified=("params", "active_params", "context"),
        ),
        ModelPreset(
            name="Qwen/Qwen3-14B-Base", params=14.8e9, active_params=14.8e9, layers=40, hidden=5120,
            intermediate=17408, heads=40, kv_heads=8, head_dim=128, vocab=151936, context=32768,
            tied_embeddings=False, unverified=("params", "active_params", "context"),
        ),
        ModelPreset(
            name="Qwen/Qwen3-30B-A3B-Base", params=30.5e9, active_params=3.3e9, layers=48, hidden=2048,
            intermediate=768, heads=32, kv_heads=4, head_dim=128, experts=128, experts_per_token=8,
            vocab=151936, context=32768, tied_embeddings=False,
            unverified=("params", "active_params", "context", "tied_embeddings"),
        ),
        ModelPreset(
            name="allenai/OLMo-3-1025-7B", params=7.3e9, active_params=7.3e9, layers=32, hidden=4096,
            intermediate=11008, heads=32, kv_heads=32, head_dim=128, vocab=100278, context=65536,
            tied_embeddings=False,
            unverified=("params", "active_params", "intermediate", "head_dim", "vocab", "context", "tied_embeddings"),
        ),
        ModelPreset(
            name="allenai/OLMo-3-1125-32B", params=32.2e9, active_params=32.2e9, layers=64, hidden=5120,
            intermediate=27648, heads=40, kv_heads=8, head_dim=128, vocab=100278, context=65536,
            tied_embeddings=False,
            unverified=("params", "active_params", "head_dim", "vocab", "context", "tied_embeddings"),
        ),
    )
}


def preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive; an ``org/`` prefix is allowed)."""
    key = name.strip().split("/")[-1].lower()
    if key not in PRESETS:
        valid = ", ".join(p.short_name for p in PRESETS.values())
        raise ValueError(f"unknown model preset {name!r}; valid: {valid}")
    return PRESETS[key]
