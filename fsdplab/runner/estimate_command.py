"""`fsdplab estimate`: a setting from the flags, checked before the model is loaded, then one estimate (a table,
JSON, a timeline, a memory snapshot) or a sweep (a table, JSON, a heat map)."""

from __future__ import annotations

import json
import math

from ..runtime import collector
from .flags import at_least, check_output_file, positive_ints
from ..settings import LORA_TARGETS, MAX_WORLD_SIZE, WORLD_SIZE_BOUND, TrainSetting


def _lora_targets(text: str):
    return text if text in LORA_TARGETS else tuple(name.strip() for name in text.split(",") if name.strip())


def _checkpointing(args):
    """--activation-checkpointing [full | K | selective | reentrant | none] as a TrainSetting field."""
    mode = args.activation_checkpointing.strip().lower()
    if mode in ("none", "full", "selective", "reentrant"):
        return {"none": False, "full": True}.get(mode, mode)
    if mode.isdigit() and int(mode) >= 1:
        return int(mode)
    raise ValueError(f"--activation-checkpointing takes full, selective, reentrant, or K (every K-th block, "
                     f"e.g. 2); got {args.activation_checkpointing!r}.")


def _strategy(args) -> str:
    """--strategy, with the older --no-reshard-after-forward meaning shard_grad_op."""
    strategy = args.strategy or ("full_shard" if args.reshard_after_forward else "shard_grad_op")
    if not args.reshard_after_forward and strategy != "shard_grad_op":
        raise ValueError(f"--no-reshard-after-forward is --strategy shard_grad_op; it contradicts --strategy "
                         f"{strategy}: drop one of them.")
    if args.shard_group_size is not None and strategy != "hybrid_shard":
        raise ValueError("--shard-group-size sets hybrid_shard's shard group: add --strategy hybrid_shard.")
    return strategy


def estimate_command(args) -> int:
    """`fsdplab estimate`: one setting -> the per-category table (or one JSON object) and whether it fits;
    comma lists, --sweep or --plot -> every combination, as a table, one JSON object, or a heat map."""
    # deferred: the estimator and the model registry import torch and transformers, which --help does not need
    from ..memory.exact import estimate
    from ..memory.checks import check
    from ..memory.sweep import sweep
    from ..models import resolve_model

    # Every flag is checked here, before the model is loaded or any estimate starts.
    seq_lens = positive_ints("--seq-len", args.seq_len)
    batch_sizes = positive_ints("--batch-size", args.batch_size)
    world_sizes = positive_ints("--world-size", args.world_size, MAX_WORLD_SIZE, WORLD_SIZE_BOUND)
    at_least("--lora-rank", args.lora_rank, 1, "16")
    at_least("--loss-chunks", args.loss_chunks, 1, "8")
    at_least("--grad-accum", args.grad_accum, 1, "4")
    if args.no_sync and args.grad_accum < 2:
        raise ValueError("--no-sync skips the gradient reduction of every micro-batch but the last: add "
                         "--grad-accum K (2 or more, e.g. --grad-accum 4).")
    at_least("--workers", args.workers, 1, "2")
    at_least("--reshard-to", args.reshard_to, 2, "8")
    for flag, given in (("--lora-targets", args.lora_targets != "all-linear"), ("--lora-dropout", args.lora_dropout),
                        ("--adapter-dtype", args.adapter_dtype != "fp32")):
        if given and args.lora_rank is None:
            raise ValueError(f"{flag} describes LoRA adapters: add --lora-rank (e.g. --lora-rank 16).")
    for flag, text in (("--plot", args.plot), ("--timeline", args.timeline)):
        if text and not text.lower().endswith(".png"):
            raise ValueError(f"{flag} writes a PNG: give a file name ending in .png, got {text!r}.")
    for flag, text in (("--plot", args.plot), ("--timeline", args.timeline),
                       ("--memory-snapshot", args.memory_snapshot)):
        if text:
            check_output_file(flag, text)      # before the estimate, not after it
    if not math.isfinite(args.gpu_mem_gib) or args.gpu_mem_gib <= 0:
        raise ValueError(f"--gpu-mem-gib is a GPU's memory in GiB, a positive number (e.g. 24), got "
                         f"{args.gpu_mem_gib}.")
    if args.shard_group_size is not None and args.shard_group_size < 1:
        raise ValueError(f"--shard-group-size is a number of GPUs (1 or more; usually a node's 8), got "
                         f"{args.shard_group_size}.")
    for world_size in world_sizes:
        if args.reshard_to is not None and world_size % args.reshard_to:
            raise ValueError(f"--reshard-to {args.reshard_to} must divide --world-size "
                             f"({world_size}): the ranks split into groups of that size "
                             f"(e.g. --reshard-to 8, one node).")
    setting = TrainSetting(model=resolve_model(args.model), world_size=world_sizes[0], lora_rank=args.lora_rank,
                           lora_targets=_lora_targets(args.lora_targets), seq_len=seq_lens[0],
                           lora_dropout=args.lora_dropout, adapter_dtype=args.adapter_dtype,
                           grad_accum=args.grad_accum, no_sync=args.no_sync,
                           batch_size=batch_sizes[0], precision=args.precision, base_dtype=args.base_dtype,
                           optimizer=args.optimizer, activation_checkpointing=_checkpointing(args),
                           strategy=_strategy(args), shard_group_size=args.shard_group_size,
                           cpu_offload=args.cpu_offload, attention=args.attention, loss_chunks=args.loss_chunks,
                           embed_head_units=args.embed_head_units, use_cache=args.use_cache,
                           reshard_to=args.reshard_to)
    for world_size in world_sizes[1:]:
        setting.replace(world_size=world_size)    # every world size valid before the sweep starts
    if args.sweep or args.plot or len(seq_lens) * len(batch_sizes) * len(world_sizes) > 1:
        if args.timeline or args.memory_snapshot:
            raise ValueError("--timeline and --memory-snapshot show one setting's step: give one --seq-len, "
                             "--batch-size and --world-size.")
        collector.resume()            # the sweep's points run in worker processes
        result = sweep(setting, seq_lens=seq_lens, batch_sizes=batch_sizes, world_sizes=world_sizes,
                       gpu_mem_gib=args.gpu_mem_gib, workers=args.workers)
        if args.plot:
            from ..display import plot_sweep

            plot_sweep(result, args.plot)
        print(json.dumps(result.to_dict()) if args.json else result.table())
        if args.plot and not args.json:
            print(f"heat map: {args.plot}")
        return 0
    check(setting, build=False)       # the estimate's build says what is wrong with the model (checks.explained)
    # The collector stays paused through the estimate: its model's build imports the model's module and peft (a
    # collection on would scan what they make, again and again), and its own cycles are a few MB at most.
    if args.memory_snapshot:
        from ..memory.exact import memory_snapshot

        report = memory_snapshot(setting, args.memory_snapshot, progress=not args.json)
    else:
        report = estimate(setting, progress=not args.json)
    collector.resume()                # the collection at exit skips what the estimate made
    if args.json:
        data = report.to_dict()
        data.update(gpu_mem_gib=args.gpu_mem_gib, fits=report.fits(args.gpu_mem_gib))
        print(json.dumps(data))
    else:
        print(report.table(gpu_mem_gib=args.gpu_mem_gib))
        print(f"  ({report.seconds:.1f} s on fake tensors)")
    if args.timeline:
        from ..display import memory_over_step_figure

        memory_over_step_figure(report, path=args.timeline)
        if not args.json:
            print(f"memory over the step: {args.timeline}")
    return 0
