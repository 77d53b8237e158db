"""A 4-bit NF4 base for QLoRA: torchao's NF4 tensor in a frozen Linear, and the bytes it stores.

torchao's `NF4Tensor` implements FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather`):
`fully_shard` splits it by rows and all-gathers its 4-bit codes and scales, not 16-bit weights. It works on
real, meta and fake tensors, so the same model runs on the ranks and in the exact estimator.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .settings import NF4_BLOCK, NF4_SCALER_BLOCK

GROUP = NF4_BLOCK * NF4_SCALER_BLOCK    # a shard holds whole groups: a multiple of 16,384 weights


def nf4():
    """torchao's NF4 tensor: (to_nf4, linear_nf4, NF4Tensor). ImportError with the fix when torchao is missing."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4
    except ImportError:
        try:                             # where torchao kept it before
            from torchao.dtypes.nf4tensor import NF4Tensor, linear_nf4, to_nf4
        except ImportError as err:
            raise ImportError("QLoRA's 4-bit base needs torchao: pip install torchao") from err
    return to_nf4, linear_nf4, NF4Tensor


class NF4Linear(nn.Linear):
    """A frozen Linear whose weight is torchao's NF4 tensor, as torchtune's FrozenNF4Linear. The weight is
    dequantized in forward, to the dtype of the input (the compute dtype)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> NF4Linear:
        to_nf4, _, _ = nf4()
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        with _codes_without_values(weight):
            new.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
        new.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        return new

    def forward(self, x):
        _, linear_nf4, _ = nf4()
        out = linear_nf4(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)


@contextlib.contextmanager
def _codes_without_values(weight):
    """On the meta device, torchao's 4-bit codes made as an empty tensor of their shape and dtype (two codes a
    byte), not by its quantization loop: a meta tensor has no values to quantize, and the loop's 200-odd chunks a
    70B matrix are dispatch alone, 60% of an NF4 model's build for an estimate. Elsewhere nothing changes."""
    if weight.device.type != "meta":
        yield
        return
    _, _, nf4_tensor = nf4()
    convert = nf4_tensor.__dict__.get("convert_to_norm_float_weight")
    if not isinstance(convert, staticmethod):          # another torchao: its own loop, as before
        yield
        return

    def codes(input_tensor, n_blocks, block_size, levels):
        return torch.empty(input_tensor.numel() // 2, dtype=torch.uint8, device=input_tensor.device)

    nf4_tensor.convert_to_norm_float_weight = staticmethod(codes)
    try:
        yield
    finally:
        nf4_tensor.convert_to_norm_float_weight = convert


def check_shardable(numel: int, shards: int, name: str = "a weight") -> None:
    """ValueError with the fix when a weight of `numel` elements cannot be NF4 shards over `shards` ranks."""
    if numel % (GROUP * shards):
        raise ValueError(f"{name} has {numel:,} weights, which cannot be NF4 shards over {shards} rank(s): torchao "
                         f"needs a multiple of {GROUP:,} x {shards}. Use sizes that are multiples of 256, or fewer "
                         "ranks.")


def apply_nf4(model: nn.Module, shards: int = 1, blocks=None) -> nn.Module:
    """QLoRA's base: every Linear of the decoder blocks becomes an NF4Linear (the embedding, the head and the
    norms stay as they are). `shards`: the ranks its weights will be sharded over (checked before anything
    changes). Call it before adding the adapters."""
    from .models import blocks_of

    blocks = blocks if blocks is not None else blocks_of(model)
    found = [(module, name, child) for block in blocks for module in block.modules()
             for name, child in module.named_children() if type(child) is nn.Linear]
    for _, name, child in found:
        check_shardable(child.weight.numel(), shards, name)
    for module, name, child in found:
        setattr(module, name, NF4Linear.from_linear(child))
    return model


def local_bytes(tensor) -> int:
    """Bytes of this rank's part of a parameter: a DTensor's shard, and for NF4 its codes, scalers and factors."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    parts = ("quantized_data", "quantized_scalers", "quantization_factor")
    if all(hasattr(local, part) for part in parts):
        return sum(getattr(local, part).nbytes for part in parts)
    return local.nbytes


def place_constants(model: nn.Module, device) -> None:
    """After `to_empty` from the meta device: each NF4 weight's two small tensors outside its shards (the 16
    levels and the scalers' mean) stay on meta, and dequantizing then mixes devices. Put them on `device`, with
    no values: for estimates on fake tensors, where only shapes and bytes count, not for training."""
    from torch.distributed.tensor import DTensor

    from ._torch_private import local_shard

    _, _, nf4_tensor = nf4()
    for p in model.parameters():
        local = local_shard(p) if isinstance(p, DTensor) else p     # the shard FSDP gathers, not an alias
        if isinstance(local, nf4_tensor):
            for name in ("nf4", "scaler_mean"):
                value = getattr(local, name)
                if value.device.type == "meta":
                    setattr(local, name, torch.empty_like(value, device=device))
