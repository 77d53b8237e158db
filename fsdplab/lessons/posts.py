"""The two blog posts as data: their training setting, their claims as they state them, the thresholds the
lessons judge them by, and the GPU cards they name. Lessons import these from here and never from each other.

Each lesson keeps its own data in its section below; the claim numbers are those of the lab's claim table.
"""

from __future__ import annotations

from ..settings import GIB, MIB, TrainSetting

# --- the posts' setting (lessons 01, 03, 06, 08) -----------------------------------------------------------
# Qwen-7B, LoRA r=64 on every linear layer, FULL_SHARD, fp16, activation checkpointing, 8 A10s. The posts give
# no sequence length and no micro-batch: 2048 x 1 is a common default the lab picks, not the posts' number.
POSTS_SETTING = TrainSetting(model="qwen-7b", world_size=8, strategy="full_shard", precision="fp16", lora_rank=64,
                             lora_alpha=128, lora_targets="all-linear", seq_len=2048, batch_size=1,
                             activation_checkpointing=True)
POSTS_BAND_GIB = (17.0, 19.0)   # claim 16: "17-19 GB per card", read as nvidia-smi's GiB

# --- GPU cards: the memory a program can see -----------------------------------------------------------------
# An A10 is sold as "24 GB" but reports 23,028 MiB (NVML total 24,146,608,128 B = 22.49 GiB); the CUDA context
# takes more before the first tensor (0.82 GiB measured on an H200). nvidia-smi shows MiB.
A10_BYTES = 23_028 * MIB
A10_GIB = A10_BYTES / GIB
CARD_GIB = {"A10": A10_GIB, "A100-80GB": 80.0, "H100-SXM": 79.65}   # H100 80GB reports 81,559 MiB
# What a lesson subtracts from a card before it says "fits": the CUDA context (0.82 GiB measured on an H200)
# and some fragmentation, which an active peak leaves out. One rule for every lesson (03's dashboard, 06's figures).
CARD_RESERVE_GIB = 1.0


def usable_gib(gpu_gib: float) -> float:
    """What a lesson lets a run's active peak take of a `gpu_gib` card: the card less CARD_RESERVE_GIB."""
    return gpu_gib - CARD_RESERVE_GIB

# --- the claims, as the posts state them -----------------------------------------------------------------------
CLAIMS = {
    1: "FSDP splits a weight matrix by column: an 8x4 matrix on 4 cards keeps 8x1 each",
    2: "ZeRO-2 keeps one gradient copy; DP differs from DDP in its replica counts",
    3: "Adam costs O(3 x params), and FSDP divides it by N",
    4: "FSDP's communication is 40% lower than DDP's",
    5: "below 13B or with LoRA, SHARD_GRAD_OP is better; 70B must use FULL_SHARD",
    6: "BACKWARD_PRE gives +15-25% throughput, holds two layers' parameters, and is tuned with gradient "
       "accumulation; forward prefetch is experimental",
    7: "PCIe is about 1/10 of GPU memory bandwidth; offload costs about 30% throughput; pair it with NVMe",
    8: "activation checkpointing costs +30% compute and saves up to 80% of activation memory",
    9: "fp16 MixedPrecision, and the optimizer keeps fp32",
    10: "mixed_precision=torch.float16; keep LayerNorm in fp32 with reduce_dtype=fp32",
    11: "size_based_auto_wrap_policy(min_num_params=1e7) passed as the policy",
    12: "three lines: FSDP(model), then Adam",
    13: "saving an FSDP model directly loses the shard information; fix it with FULL_STATE_DICT",
    14: "safe_save: only rank 0 calls model.state_dict() inside FULL_STATE_DICT",
    15: "8 x A10 are consumer GPUs, and sharding is why a 7B model fits",
    16: "Qwen-7B LoRA r=64 on 8 x A10 peaks at 17-19 GB per card",
    17: "Llama-7B: DDP 78 GB, FSDP 24 GB, FSDP + offload 12 GB; 120 / 95 / 65 samples/s",
    18: "ResNet-152: DDP 23 GB against FSDP 9 GB on a V100",
    19: "NVSwitch 300 GB/s; ordinary Ethernet 10-25 GB/s; a UCX+NCCL joint backend",
    20: "ms-swift config: train: activation_checkpointing: true",
}

# --- lesson 01 ---------------------------------------------------------------------------------------------------
CLAIM17_GB = {"ddp": 78, "fsdp": 24, "offload": 12}   # claim 17: Llama-7B per GPU, decimal GB as the posts write

# --- lesson 02 ---------------------------------------------------------------------------------------------------

# --- lesson 03 ---------------------------------------------------------------------------------------------------

# --- lesson 04 ---------------------------------------------------------------------------------------------------

# --- lesson 05 ---------------------------------------------------------------------------------------------------

# --- lesson 06 ---------------------------------------------------------------------------------------------------

# --- lesson 07 ---------------------------------------------------------------------------------------------------

# --- lesson 08 ---------------------------------------------------------------------------------------------------
