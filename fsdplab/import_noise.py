"""Lines that libraries print and no learner can act on, dropped one message at a time.

peft imports torchao whenever it is installed (the QLoRA lesson needs it), and torchao's import logs a warning
for each CUDA kernel library a CPU build of torch cannot load, and torch logs a deprecation of how torchao
registers two enums. peft's get_peft_model asks transformers' deprecated `is_gradient_checkpointing`, a
FutureWarning meant for peft. Every lesson that uses peft would show them on every rank. The filters match
those messages only: any other warning from these loggers, and any other FutureWarning, still shows.
"""

import logging
import warnings

# logger name -> the start of each message dropped from it
DROPPED = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("<enum ",),
}


class _Drop(logging.Filter):
    def __init__(self, starts: tuple):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def install() -> None:
    """Attach the filters (once; importing fsdplab calls it, before anything imports peft)."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    for name, starts in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(starts))
