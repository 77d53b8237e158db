"""What the estimator rejects, said before minutes are spent and in words that say what to do.

`check(setting)` rejects a sequence longer than the model's positions, LoRA targets that match no module and
an architecture transformers cannot build, by building the model on the meta device (a deep stack as the
estimate's traced twin, fsdplab.memory.block_repeat: the same modules fail the same way). `explained(setting)`
turns the errors of that build into those words wherever it runs: `check(setting, build=False)` leaves the
build to the estimate that follows, which makes the same one (`fsdplab estimate` of one setting: one build of
the model, not two).
"""

from __future__ import annotations

from contextlib import contextmanager

from . import block_repeat
from ..settings import TrainSetting


def check(setting: TrainSetting, build: bool = True) -> None:
    """ValueError, with the fix, for a setting the estimator would reject late or confusingly; without `build`,
    only what needs no model built (the estimate's own build says the rest, `explained`)."""
    from ..custom import custom_of
    from ..models import config_of

    config = config_of(setting.model)
    custom = custom_of(config)
    if custom is None:
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and setting.seq_len > limit:
            raise ValueError(f"seq_len {setting.seq_len} is over the model's maximum ({limit} positions, "
                             f"max_position_embeddings): use --seq-len {limit} or less.")
    if build:
        from ..sharding import build_model

        twin = None if custom is not None else block_repeat.shallow_twin(setting, config)
        with explained(setting):
            build_model(setting if twin is None else setting.replace(model=twin), device="meta",
                        dtype=setting.base_dtype)


@contextmanager
def explained(setting: TrainSetting):
    """The errors of building `setting`'s model on the meta device, as ValueErrors that say what to do."""
    from ..custom import custom_of
    from ..models import architecture_of, config_of

    try:
        yield
    except Exception as e:
        config = config_of(setting.model)
        custom = custom_of(config)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if custom is not None:
            if isinstance(e, ValueError):
                raise                        # the lab's own refusals say what to do already
            raise ValueError(f"{custom.name}: building it on the meta device failed ({type(e).__name__}: {first}); "
                             "build() must make the module without reading weights (no .item(), no file).") from None
        if isinstance(e, ValueError) and "not found in the base model" in str(e):  # peft: targets match nothing
            from ..sharding import lora_target_modules

            names = sorted(_linear_names(setting))
            raise ValueError(f"LoRA targets {lora_target_modules(setting.lora_targets)} match no module of "
                             f"{architecture_of(config)}; its Linear layers are {', '.join(names)}: pass some of "
                             "these, comma-separated, or --lora-targets all-linear.") from None
        raise ValueError(f"transformers cannot build {architecture_of(config)} on the meta device "
                         f"({type(e).__name__}: {first}); check the config.") from None


def _linear_names(setting: TrainSetting) -> set:
    """Names of the Linear layers inside the blocks (what LoRA targets), from a meta build without LoRA."""
    from torch import nn

    from ..models import blocks_of, causal_lm

    model = causal_lm(setting.model)
    return {name.rsplit(".", 1)[-1] for block in blocks_of(model)[:1]
            for name, module in block.named_modules() if isinstance(module, nn.Linear)}
