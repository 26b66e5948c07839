"""A model's geometry: the shape the capacity plan needs, from a stack file's `geometry` block or a pinned table.

The field names are the Hugging Face `config.json` keys, so a block can be
copied from the model's own config. The pinned table holds the model
families the README's example stacks serve; each entry says where its
numbers come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Geometry(BaseModel):
    """A decoder-only transformer's shape, as its `config.json` gives it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    # The context limit: the longest sequence the model was built for.
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _default_head_dim(cls, data: Any) -> Any:
        # As vLLM reads a config.json without head_dim: hidden_size / num_attention_heads.
        if isinstance(data, dict) and data.get("head_dim") is None:
            hidden, heads = data.get("hidden_size"), data.get("num_attention_heads")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
                return {**data, "head_dim": hidden // heads}
        return data

    @model_validator(mode="after")
    def _check_groups(self) -> Geometry:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads}): each KV head serves a whole group of attention heads"
            )
        return self

    @property
    def vocab_parameters(self) -> int:
        """Parameters of the token embedding and the LM head (one matrix when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


@dataclass(frozen=True)
class PinnedModel:
    """A model family the plan knows without a `geometry` block."""

    hub_id: str
    geometry: Geometry
    parameters: int
    source: str
    aliases: tuple[str, ...] = ()

    def names(self) -> set[str]:
        """The lower-case names a stack's model may go by: the hub name and its aliases."""
        return {self.hub_id.split("/")[-1].lower(), *(a.lower() for a in self.aliases)}


_LLAMA_31_8B = Geometry(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
)
_LLAMA_3_70B = Geometry(
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=8192,
    intermediate_size=28672,
    vocab_size=128256,
    max_position_embeddings=131072,
)

# The numbers are the models' `config.json` on the Hugging Face hub (layers,
# heads, KV heads, head_dim, hidden and intermediate size, vocabulary,
# max_position_embeddings, untied embeddings); the parameter counts are the
# hub's safetensors totals, which the geometry adds up to exactly.
PINNED: tuple[PinnedModel, ...] = (
    PinnedModel(
        "meta-llama/Llama-3.1-8B-Instruct",
        _LLAMA_31_8B,
        8_030_261_248,
        "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json",
        aliases=("Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B"),
    ),
    PinnedModel(
        "meta-llama/Llama-3.3-70B-Instruct",
        _LLAMA_3_70B,
        70_553_706_496,
        "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/blob/main/config.json",
        aliases=("Llama-3.1-70B-Instruct", "Llama-3.1-70B", "Meta-Llama-3.1-70B-Instruct"),
    ),
)


def _names(source: str, model_id: str) -> set[str]:
    """The names a model goes by: the last part of its source (the hub id it was copied from) and its model_id."""
    return {source.rstrip("/").split("/")[-1].lower(), model_id.split("/")[-1].lower()}


def pinned_model(source: str, model_id: str) -> PinnedModel | None:
    """The pinned family whose hub name is the source's last path part or the model_id (case-insensitive)."""
    names = _names(source, model_id)
    return next((p for p in PINNED if p.names() & names), None)


def resolve_geometry(geometry: Geometry | None, source: str, model_id: str) -> Geometry | None:
    """The stack's own `geometry` block, else the pinned family's, else None (the model is unknown)."""
    if geometry is not None:
        return geometry
    pinned = pinned_model(source, model_id)
    return pinned.geometry if pinned else None


def unknown_model_message(name: str, source: str, model_id: str) -> str:
    """Why a model without geometry is refused, in one line."""
    fields = ", ".join(Geometry.model_fields)
    known = ", ".join(p.hub_id for p in PINNED)
    return (
        f"'{name}' ({source}, model_id '{model_id}') is not a model of the pinned table ({known}): "
        f"add a geometry block from its config.json ({fields}) so its KV cache can be planned"
    )
