"""A model of your own for the estimator and for live measurement: any `nn.Module`, with its batch and its loss.
(`sharding.build_model` builds one; this module imports nothing of fsdplab, so every wing may import it.)

In Python, a `CustomModel` is a TrainSetting's `model`. On the CLI (`fsdplab estimate --model pkg.mod:function`)
and wherever a setting goes to another process, the model is "package.module:function", a function of no
arguments that returns a CustomModel: each process imports it. Example (a 1B `nn.Transformer`, as Lightning's FSDP
guide measures one): `fsdplab.memory.published.lightning_transformer`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class CustomModel:
    """`build()` returns the module (the estimator calls it under `torch.device("meta")`; a live measurement on
    the rank's device). `batch(batch_size, seq_len)` returns one step's input: a dict of keyword arguments or a
    tuple of tensors (made on the CPU: the estimator makes them fake, a live run moves them to the rank's
    device). `loss(model, batch)` returns the scalar loss. `blocks(model)` lists the modules that become FSDP
    units and checkpointed blocks, in order (None: the whole model is one unit and cannot be checkpointed)."""

    build: Callable
    batch: Callable
    loss: Callable
    blocks: Callable | None = None
    name: str = "custom model"
    spec: str | None = None            # "package.module:function" when it was loaded from one

    @property
    def name_or_path(self) -> str:     # how a TrainSetting names a model (settings.model_name)
        return self.name


def is_spec(model) -> bool:
    """Whether `model` names a custom model as "package.module:function"."""
    return isinstance(model, str) and ":" in model


def custom_of(model) -> CustomModel | None:
    """The CustomModel a setting's `model` is or names, or None for a transformers model or a parameter count."""
    if isinstance(model, CustomModel):
        return model
    return load(model) if is_spec(model) else None


@functools.lru_cache(maxsize=16)
def load(spec: str) -> CustomModel:
    """Import "package.module:function" and call the function; ValueError with the fix when that fails."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for the model {spec!r} ({e}): the module must be "
                         "importable here (installed, or on PYTHONPATH).") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {function_name!r} for the model {spec!r}.")
    made = function()
    if not isinstance(made, CustomModel):
        raise ValueError(f"{spec} returned a {type(made).__name__}, not a fsdplab.custom.CustomModel (its build, "
                         "batch and loss functions).")
    return dataclasses.replace(made, spec=spec)


def check(custom: CustomModel, setting) -> None:
    """Refuse the settings a custom model cannot take, with the reason."""
    if setting.lora_rank is not None:
        raise ValueError("lora_rank applies to transformers models: put your own adapters inside build() and "
                         "freeze what they leave out (requires_grad=False).")
    if setting.base_dtype == "nf4":
        raise ValueError("an NF4 base needs a transformers model (fsdplab.nf4 quantizes its blocks' Linears).")
    if custom.blocks is None and (setting.activation_checkpointing or setting.embed_head_units):
        raise ValueError("activation checkpointing and own embedding/head units need blocks=: give the "
                         "CustomModel a blocks(model) function.")
    if setting.embed_head_units:
        raise ValueError("embed_head_units needs a transformers LM (its input and output embeddings).")
    if setting.loss_chunks != 1 or setting.use_cache:
        raise ValueError("loss_chunks and use_cache apply to transformers LMs: write them into your loss.")


def blocks(custom: CustomModel, model) -> list:
    """The FSDP units of `model` (after checkpointing wrapped them); [] where the whole model is one unit."""
    return [] if custom.blocks is None else list(custom.blocks(model))


def batch(custom: CustomModel, setting, device=None):
    """One step's input for `setting`'s batch size and sequence length, on `device` (None: where it is made)."""
    made = custom.batch(setting.batch_size, setting.seq_len)
    if device is None:
        return made
    if isinstance(made, dict):
        return {k: v.to(device) for k, v in made.items()}
    return tuple(t.to(device) for t in made)
