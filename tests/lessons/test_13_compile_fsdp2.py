"""Lesson 13's module and its code exercise, checked on the live ranks: the block whose forward breaks the graph,
tried with the fixes that pass and with the wrong ones a learner writes. Also what the lesson relies on dynamo to
say (graphs, breaks, their reasons; FSDP2's hooks break a whole-model graph), so that a torch release that
changes it fails here, not in a lesson's prose."""

import inspect

import torch
from torch import nn

from fsdplab.exercises import check
from fsdplab.lessons import compile_fsdp2 as lesson
from fsdplab.models import Block, TinyConfig


class Planted(Block):                          # the lesson's block: a Python branch on a tensor's value
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        peak = x.abs().amax()
        if peak > self.limit:
            x = x * (self.limit / peak)
        return x


class ClampedScale(Block):                     # fixed: the decision as a tensor operation
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        return x * torch.clamp(self.limit / x.abs().amax(), max=1.0)


class Where(Block):                            # fixed another way
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        peak = x.abs().amax()
        return torch.where(peak > self.limit, x * (self.limit / peak), x)


class ItemBranch(Block):                       # wrong: the branch on a Python float still breaks
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        peak = x.abs().amax()
        if peak.item() > self.limit:
            x = x * (self.limit / peak)
        return x


class NoGuard(Block):                          # wrong: no break, because the guard is gone
    limit = lesson.LIMIT


class ClampEach(Block):                        # wrong: clamps each value instead of rescaling the whole output
    limit = lesson.LIMIT

    def forward(self, x):
        return super().forward(x).clamp(-self.limit, self.limit)


class AlwaysScale(Block):                      # wrong: rescales every output, also those below the limit
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        return x * (self.limit / x.abs().amax())


class DetachedScale(Block):                    # wrong: same outputs, but no gradient through the peak
    limit = lesson.LIMIT

    def forward(self, x):
        x = super().forward(x)
        return x * torch.clamp(self.limit / x.abs().amax().detach(), max=1.0)


def _not_yet(verdict, *words):
    assert not verdict.ok, verdict
    assert "\n" not in verdict.message, verdict
    assert all(word in verdict.message for word in words), verdict


def test_fixed_blocks_pass(cluster):
    for answer in (ClampedScale, Where):
        verdict = check("13-graph-break", answer, cluster=cluster)
        assert verdict.ok, (answer.__name__, verdict)
        assert "1 graph per block, no break" in verdict.message, verdict
        assert "1 of 2 blocks rescaled" in verdict.message, verdict   # both sides of the branch were taken


def test_a_class_written_in_a_notebook_cell_passes(cluster):
    """A class defined where the ranks cannot import it travels by value and is rebuilt there; its zero-argument
    super() must still work (the lesson's exercise cell defines the class in the notebook)."""
    class Mine(Block):
        limit = lesson.LIMIT

        def forward(self, x):
            x = super().forward(x)
            return x * torch.clamp(self.limit / x.abs().amax(), max=1.0)

    assert check("13-graph-break", Mine, cluster=cluster).ok


def test_blocks_that_still_break_hear_the_count_and_the_reason(cluster):
    _not_yet(check("13-graph-break", Planted, cluster=cluster), "still 1 graph break", "2 graphs instead of 1",
             "dynamo says: Data-dependent branching", "at `if peak > self.limit:`", "tensor operations")
    _not_yet(check("13-graph-break", ItemBranch, cluster=cluster), "still 1 graph break",
             "Unsupported Tensor.item() call", "at `if peak.item() > self.limit:`")


def test_blocks_that_compute_something_else_hear_the_gap(cluster):
    _not_yet(check("13-graph-break", NoGuard, cluster=cluster), "no graph break any more",
             "blocks' outputs differ from the planted block's", "rescaled 1 of 2 blocks")
    _not_yet(check("13-graph-break", ClampEach, cluster=cluster), "blocks' outputs differ from the planted block's")
    _not_yet(check("13-graph-break", AlwaysScale, cluster=cluster), "blocks' outputs differ from the planted block's")
    _not_yet(check("13-graph-break", DetachedScale, cluster=cluster), "the same outputs, but the gradients differ")


def test_not_a_class_or_a_class_that_fails(cluster):
    _not_yet(check("13-graph-break", ClampedScale(TinyConfig()), cluster=cluster), "expected your block class")

    class Raises(Block):
        def forward(self, x):
            raise ValueError("no block today\nsecond line")

    verdict = check("13-graph-break", Raises, cluster=cluster)
    _not_yet(verdict, "no block today")
    assert "second line" not in verdict.message
    assert check("13-graph-break", ClampedScale, cluster=cluster).ok          # the ranks still work


def test_the_counter_and_explain_say_what_the_lesson_prints():
    block = Block(TinyConfig())
    x = torch.randn(2, 8, 64)
    found = lesson.explain(block, x)
    assert (found["graphs"], found["breaks"], found["reasons"]) == (1, 0, []), found
    planted = lesson.explain(Planted(TinyConfig()).eval(), x * 10)
    assert planted["breaks"] == 1 and planted["graphs"] == 2, planted
    assert "\n" not in planted["reasons"][0], planted
    counter = lesson.GraphCounter("aot_eager")
    torch.compiler.reset()
    out = torch.compile(block, backend=counter, fullgraph=True)(x)
    assert counter.count == 1 and counter.ops > 5 and torch.allclose(out, block(x)), counter.graphs
    assert found["ops"] == counter.ops, (found, counter.graphs)     # the lesson prints one count for one graph
    assert lesson.fullgraph_error(block, x) is None
    assert lesson.fullgraph_error(Planted(TinyConfig()), x * 10).startswith("Data-dependent branching (")
    said = lesson.break_reason(Planted(TinyConfig()), x * 10)
    line = inspect.getsourcelines(Planted)[1] + 6                      # Planted's `if`, 6 lines below `class`
    assert said.startswith("Data-dependent branching (") and said.endswith(f"at `if peak > self.limit:` (line {line})")
    assert lesson.break_reason(block, x) is None


def test_an_item_in_the_middle_breaks_and_fullgraph_lets_it_pass():
    """Section 3's claims: `.item()` between two parts of a forward is one break and two graphs in `explain`; with
    fullgraph=True dynamo captures it as a symbolic number and compiles, so the flag does not report it."""
    class Logged(Block):
        def forward(self, x):
            x = x + self.mlp(self.norm1(x))
            self.peak = x.abs().amax().item()
            return x + self.mlp(self.norm2(x))

    x = torch.randn(2, 8, 64)
    found = lesson.explain(Logged(TinyConfig()), x)
    assert (found["graphs"], found["breaks"]) == (2, 1) and "Tensor.item()" in found["reasons"][0], found
    assert lesson.fullgraph_error(Logged(TinyConfig()), x) is None
    said = lesson.break_reason(Logged(TinyConfig()), x)
    assert said.startswith("Unsupported Tensor.item() call") and "at `self.peak = x.abs().amax().item()`" in said


def test_saved_for_backward_counts_distinct_storages():
    weight = nn.Parameter(torch.ones(4, 4))
    x = torch.ones(3, 4, requires_grad=True)
    saved = lesson.saved_for_backward(lambda: (x @ weight).sum())
    assert saved == {"tensors": 2, "bytes": 3 * 4 * 4 + 4 * 4 * 4}, saved     # x and weight, for mm's backward
    both = lesson.saved_for_backward(lambda: (x @ weight + x @ weight).sum())
    assert both["tensors"] == 4 and both["bytes"] == saved["bytes"], both    # the same two storages, twice


def test_fsdp_hooks_break_a_whole_model_graph(cluster):
    """What section 2 shows: the whole sharded model under fullgraph=True fails at FSDP2's hook; the blocks,
    compiled before fully_shard, compile whole."""
    def on_rank():
        from torch.distributed.fsdp import fully_shard

        from fsdplab.models import random_batch
        from fsdplab.ranks import mesh, rank
        from fsdplab.sharding import build_tiny

        cfg = TinyConfig(num_layers=2)
        tokens, _ = random_batch(cfg, batch_size=2, seed=rank())
        model = build_tiny(cfg)
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, backend="aot_eager", fullgraph=True))
        for block in model.layers:
            fully_shard(block, mesh=mesh())
        fully_shard(model, mesh=mesh())
        model(tokens).sum().backward()                       # per block, fullgraph=True: no error
        whole = build_tiny(cfg)
        for block in whole.layers:
            fully_shard(block, mesh=mesh())
        fully_shard(whole, mesh=mesh())
        return lesson.fullgraph_error(whole, tokens)

    errors = cluster.run(on_rank, quiet=True)
    assert all(e and "Attempted to call function marked as skipped" in e for e in errors), errors
