"""Lesson 03's code exercise, "03-offload-setup": the learner's offloaded sharding and optimizer, run on the live ranks.
The right setup passes; each wrong one a learner writes gets a line that says what is wrong."""

import torch

import fsdplab
from fsdplab.exercises import check


def _setup(policy="host", blocks="offload", root="offload", optimizer="after", give_back=True):
    """A learner's setup(model, mesh). policy: "host" (pinned only with a GPU), "pinned" or "base" (OffloadPolicy);
    blocks / root: "offload", "plain" (sharded without the policy) or "skip"; optimizer: "after" or "before"
    sharding."""
    def setup(model, mesh):
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        chosen = {"host": lambda: CPUOffloadPolicy(pin_memory=torch.cuda.is_available()),
                  "pinned": CPUOffloadPolicy, "base": OffloadPolicy}[policy]()
        early = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer == "before" else None
        for part, how in ((list(model.blocks), blocks), ([model], root)):
            for module in part if how != "skip" else []:
                fully_shard(module, mesh=mesh, **({"offload_policy": chosen} if how == "offload" else {}))
        opt = early or torch.optim.AdamW(model.parameters(), lr=1e-3)
        return opt if give_back else None
    return setup


def _not_yet(verdict, *words):
    """Not ok, says `words` in one line, and gives no code away."""
    assert not verdict.ok and all(word in verdict.message for word in words), verdict.message
    assert "CPUOffloadPolicy(" not in verdict.message and "\n" not in verdict.message, verdict.message
    assert "Traceback" not in verdict.message, verdict.message


def test_offload_setup_checker(cluster):
    right = check("03-offload-setup", _setup(), cluster=cluster)
    assert right.ok and "the 3 blocks and the root offload" in right.message, right.message
    assert "only a GPU rank shows" in right.message, right.message          # what CPU ranks cannot show
    _not_yet(check("03-offload-setup", _setup(blocks="plain", optimizer="before", root="plain"), cluster=cluster),
             "no unit offloads", "blocks.0, blocks.1, blocks.2 and the root", "got an offload policy")
    _not_yet(check("03-offload-setup", _setup(blocks="plain"), cluster=cluster),
             "only the root offloads", "the 3 blocks")
    _not_yet(check("03-offload-setup", _setup(root="plain"), cluster=cluster),
             "the root does not", "embed, norm and head")
    _not_yet(check("03-offload-setup", _setup(root="skip"), cluster=cluster),
             "root was not wrapped", "embed, norm and head")
    _not_yet(check("03-offload-setup", _setup(policy="base"), cluster=cluster), "base class", "offload nothing")
    _not_yet(check("03-offload-setup", _setup(optimizer="before"), cluster=cluster),
             "left every shard as it was", "before fully_shard replaced them")
    _not_yet(check("03-offload-setup", _setup(give_back=False), cluster=cluster), "returns None")


def test_offload_setup_refuses_what_cannot_run(cluster):
    _not_yet(check("03-offload-setup", 3, cluster=cluster), "expected a function")
    if not torch.cuda.is_available():                      # pinned host memory needs a GPU on the machine
        _not_yet(check("03-offload-setup", _setup(policy="pinned"), cluster=cluster),
                 "raised on the ranks: RuntimeError", "pin only where a GPU is")

    def raises(model, mesh):
        raise ValueError("no blocks here\nsecond line")

    raised = check("03-offload-setup", raises, cluster=cluster)
    _not_yet(raised, "your setup raised on the ranks: ValueError: no blocks here")
    assert "second line" not in raised.message                              # the error's first line only
    assert check("03-offload-setup", _setup(), cluster=cluster).ok          # the ranks are fine after it
    _not_yet(check("03-offload-setup", _setup(), cluster=fsdplab.Cluster(2)), "stopped", "cluster.start()")


class _GPURanks:
    """Stands in for a cluster of 2 GPU ranks: answers with what `compare_offload` returns there."""

    running, broken = True, None

    def __init__(self, pinned=True, peak=300_000, where="cpu"):
        self.pinned, self.peak, self.where = pinned, peak, where

    def run(self, fn, *args):
        units = [{"unit": unit, "policy": "CPUOffloadPolicy", "offload": True, "pinned": self.pinned,
                  "owners": owners} for unit, owners in (("root", ["embed", "norm", "head"]),
                                                         ("blocks.0", ["blocks.0"]), ("blocks.1", ["blocks.1"]),
                                                         ("blocks.2", ["blocks.2"]))]
        where = {"parameters": [self.where], "gradients": ["cpu"], "optimizer state": ["cpu"]}
        return [{"rank": r, "world_size": 2, "device": "cuda", "blocks": ["blocks.0", "blocks.1", "blocks.2"],
                 "ref_loss": 4.6, "ref_peak": 600_000, "units": units, "plain": [], "returned": "AdamW",
                 "optimizer": True, "params": 22, "not_held": [], "stale": [], "loss": 4.6, "where": where,
                 "peak": self.peak, "gap": 1e-7, "unchanged": []} for r in range(2)]


def test_what_only_a_gpu_shows_is_judged_too():
    right = check("03-offload-setup", _setup(), cluster=_GPURanks())
    assert right.ok and "lived on the CPU" in right.message and "0.29 MiB" in right.message, right.message
    _not_yet(check("03-offload-setup", _setup(), cluster=_GPURanks(pinned=False)), "unpinned host memory")
    _not_yet(check("03-offload-setup", _setup(), cluster=_GPURanks(where="cuda")), "sharded parameters lived on cuda")
    _not_yet(check("03-offload-setup", _setup(), cluster=_GPURanks(peak=700_000)), "offload should lower it")
