"""The older name of fsdplab.ranks (what lesson code calls on a rank: rank(), device(), mesh(), first_ranks(), ...).
It read as torch's `dist` in every %%ranks cell; it still works, with a note naming the new one."""

import warnings

from . import ranks as _ranks


def __getattr__(name):
    value = getattr(_ranks, name)   # AttributeError for a name neither module has
    warnings.warn(f"fsdplab.dist.{name} is now fsdplab.ranks.{name} (fsdplab.dist read as torch.distributed).",
                  FutureWarning, stacklevel=2)
    return value
