"""Lesson 14's code exercises, checked on the live ranks: the reference ring, DDP and ZeRO-1 pass, and the
wrong ones a learner writes hear, in one line, what is wrong. The answers are defined on the ranks by
source, as a %%ranks cell defines them, and named to the checker."""

import textwrap

from fsdplab.exercises import check
from fsdplab.lessons import build_ddp
from fsdplab.network import mean_sent_bytes, ring_sent_bytes

RING = {
    "naive": """
        def ring(tensor):                       # everything to rank 0, the sum back to everyone
            n, r = dist.get_world_size(), dist.get_rank()
            if r == 0:
                for peer in range(1, n):
                    buffer = torch.empty_like(tensor)
                    dist.recv(buffer, peer)
                    tensor.add_(buffer)
                for peer in range(1, n):
                    dist.send(tensor, peer)
            else:
                dist.send(tensor, 0)
                dist.recv(tensor, 0)
    """,
    "reduce_scatter_only": """
        def ring(tensor):
            n, r = dist.get_world_size(), dist.get_rank()
            chunks = list(tensor.view(-1).tensor_split(n))
            for step in range(n - 1):
                send, recv = chunks[(r - step) % n], chunks[(r - step - 1) % n]
                buffer = torch.empty_like(recv)
                for request in (dist.isend(send, (r + 1) % n), dist.irecv(buffer, (r - 1) % n)):
                    request.wait()
                recv.add_(buffer)
    """,
    "mean": """
        def ring(tensor):
            lesson.reference_ring(tensor)
            tensor /= dist.get_world_size()
    """,
    "one_step_short": """
        def ring(tensor):                       # the reduce-scatter stops one step early
            n, r = dist.get_world_size(), dist.get_rank()
            chunks = list(tensor.view(-1).tensor_split(n))
            for phase, steps in (("rs", n - 2), ("ag", n - 1)):
                for step in range(steps):
                    shift = step if phase == "rs" else step - 1
                    send, recv = chunks[(r - shift) % n], chunks[(r - shift - 1) % n]
                    buffer = torch.empty_like(recv)
                    for request in (dist.isend(send, (r + 1) % n), dist.irecv(buffer, (r - 1) % n)):
                        request.wait()
                    recv.add_(buffer) if phase == "rs" else recv.copy_(buffer)
    """,
    "collective": """
        def ring(tensor):
            dist.all_reduce(tensor)
    """,
    "stub": '''
        def ring(tensor):
            """Sum over the ranks, in place."""
            ...
    ''',
    "raises": """
        def ring(tensor):
            raise ValueError("no ring today\\nsecond line")
    """,
}

DDP = {
    "sum": """
        class Wrong(lesson.ReferenceDDP):
            def finish(self):
                if self.bucket:
                    self._launch()
                for params, flat, handle in self.launched:
                    handle.wait()
                    for p, g in zip(params, flat.split([p.grad.numel() for p in params])):
                        p.grad.copy_(g.view_as(p.grad))
                self.launched = []
    """,
    "no_broadcast": """
        class Wrong(lesson.ReferenceDDP):
            def __init__(self, module, bucket_bytes):
                torch.nn.Module.__init__(self)
                self.module, self.bucket_bytes, self.sync = module, bucket_bytes, True
                self.bucket, self.launched = [], []
                for p in module.parameters():
                    p.register_post_accumulate_grad_hook(self._ready)
    """,
    "after_backward": """
        class Wrong(lesson.ReferenceDDP):          # the same buckets, all launched in finish()
            def _ready(self, param):
                if self.sync:
                    self.bucket.append(param)

            def finish(self):
                params, self.bucket = self.bucket, []
                for p in params:
                    self.bucket.append(p)
                    if sum(q.grad.numel() * q.grad.element_size() for q in self.bucket) >= self.bucket_bytes:
                        self._launch()
                lesson.ReferenceDDP.finish(self)
    """,
    "no_sync_reduces": """
        import contextlib
        class Wrong(lesson.ReferenceDDP):
            @contextlib.contextmanager
            def no_sync(self):
                yield
                self.finish()
    """,
    "no_sync_drops": """
        import contextlib
        class Wrong(lesson.ReferenceDDP):
            @contextlib.contextmanager
            def no_sync(self):
                self.sync = False
                yield
                self.sync = True
                for p in self.module.parameters():
                    p.grad = None
    """,
    "stub": '''
        import contextlib
        class Wrong(torch.nn.Module):
            def __init__(self, module, bucket_bytes):
                torch.nn.Module.__init__(self)
                self.module = module
            def forward(self, *args):
                return self.module(*args)
            def finish(self):
                """Wait, average."""
                ...
            @contextlib.contextmanager
            def no_sync(self):
                yield
    ''',
}

ZERO = {
    "every_rank": """
        class Wrong(lesson.ReferenceZeRO1):        # every rank keeps state for every parameter
            def __init__(self, params, optimizer_class, **kwargs):
                self.params = list(params)
                self.owner = [0] * len(self.params)
                self.inner = optimizer_class(self.params, **kwargs)
    """,
    "no_broadcast": """
        class Wrong(lesson.ReferenceZeRO1):
            def step(self):
                for p in self.params:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
                if self.inner is not None:
                    self.inner.step()
    """,
    "no_average": """
        class Wrong(lesson.ReferenceZeRO1):
            def step(self):
                if self.inner is not None:
                    self.inner.step()
                for p, owner in zip(self.params, self.owner):
                    dist.broadcast(p.data, src=owner)
    """,
    "stub": '''
        class Wrong:
            def __init__(self, params, optimizer_class, **kwargs):
                self.params = list(params)
            def step(self):
                """Average, step my part, send it."""
                ...
    ''',
}

# Right answers written as a learner fills the notebook's skeletons, each in its own way (not the references).
MINE = {
    "ring": """
        def ring(tensor):                       # blocking send/recv: even ranks send first, odd ranks receive first
            n, r = dist.get_world_size(), dist.get_rank()
            chunks = tensor.view(-1).chunk(n)
            for step in range(2 * (n - 1)):
                gather = step >= n - 1
                s = step - (n - 1) if gather else step
                i_send, i_recv = (r - s + gather) % n, (r - s - 1 + gather) % n
                incoming = torch.empty_like(chunks[i_recv])
                if r % 2 == 0:
                    dist.send(chunks[i_send].clone(), (r + 1) % n)
                    dist.recv(incoming, (r - 1) % n)
                else:
                    dist.recv(incoming, (r - 1) % n)
                    dist.send(chunks[i_send].clone(), (r + 1) % n)
                chunks[i_recv].copy_(incoming) if gather else chunks[i_recv].add_(incoming)
    """,
    "ddp": """
        import contextlib
        class Mine(torch.nn.Module):
            def __init__(self, module, bucket_bytes):
                super().__init__()
                self.module, self.bucket_bytes = module, bucket_bytes
                self.sync = True
                self.bucket, self.launched = [], []
                for p in module.parameters():
                    dist.broadcast(p.detach(), src=0)
                    p.register_post_accumulate_grad_hook(self._ready)

            def forward(self, *args):
                return self.module(*args)

            def _ready(self, p):
                if self.sync:
                    self.bucket.append(p)
                    if sum(q.grad.nbytes for q in self.bucket) >= self.bucket_bytes:
                        self._go()

            def _go(self):
                flat = torch.cat([q.grad.flatten() for q in self.bucket]) / dist.get_world_size()   # mean first
                self.launched.append((self.bucket, flat, dist.all_reduce(flat, async_op=True)))
                self.bucket = []

            def finish(self):
                if self.bucket:
                    self._go()
                for params, flat, handle in self.launched:
                    handle.wait()
                    offset = 0
                    for q in params:
                        q.grad.copy_(flat[offset:offset + q.numel()].view_as(q))
                        offset += q.numel()
                self.launched = []

            @contextlib.contextmanager
            def no_sync(self):
                self.sync = False
                yield
                self.sync = True
    """,
    "zero1": """
        class Mine:                              # round-robin by index: uneven, still each state once
            def __init__(self, params, optimizer_class, **kwargs):
                self.params = list(params)
                n, r = dist.get_world_size(), dist.get_rank()
                self.mine = optimizer_class(self.params[r::n], **kwargs)

            def step(self):
                n = dist.get_world_size()
                for p in self.params:
                    dist.all_reduce(p.grad)
                    p.grad.div_(n)
                self.mine.step()
                for i, p in enumerate(self.params):
                    dist.broadcast(p.data, src=i % n)
    """,
}

HEAD = "import torch\nimport torch.distributed as dist\nfrom fsdplab.lessons import build_ddp as lesson\n"


def _define(cluster, source: str, name: str) -> str:
    cluster.execute(HEAD + textwrap.dedent(source), quiet=True)
    return name


def _not_yet(verdict, *words, secret=()):
    """Not ok, one line, says `words`, and does not give the answer's key call away."""
    assert not verdict.ok, verdict
    assert "\n" not in verdict.message, verdict
    assert all(word in verdict.message for word in words), verdict
    assert not any(call in verdict.message for call in secret), verdict


def test_the_ring_fraction(cluster):
    assert check("14-ring-fraction", lambda N: 2 * (N - 1) / N, cluster=cluster).ok
    _not_yet(check("14-ring-fraction", lambda N: (N - 1) / N, cluster=cluster), "at N=2", "measured")
    _not_yet(check("14-ring-fraction", lambda N: 2.0, cluster=cluster), "at N=1")
    _not_yet(check("14-ring-fraction", 1.0, cluster=cluster), "expected a function")


def test_the_reference_ring_passes_by_name_and_by_value(cluster):
    from fsdplab.lessons import build_ddp as lesson

    verdict = check("14-ring", lesson.reference_ring, cluster=cluster)
    assert verdict.ok and "8,192 B tensor" in verdict.message, verdict      # 2 ranks: 1024 x 2 fp32
    assert check("14-ring", _define(cluster, "def ring(tensor):\n    lesson.reference_ring(tensor)", "ring"),
                 cluster=cluster).ok


def test_wrong_rings_hear_what_is_wrong(cluster):
    def ring(kind):
        return check("14-ring", _define(cluster, RING[kind], "ring"), cluster=cluster)

    _not_yet(ring("naive"), "the right sum on every rank, but rank 0 sent 8,192 B", "8,192 B in one message",
             "at most 4,096 B at a time")
    _not_yet(ring("reduce_scatter_only"), "wrong sum on rank 0 in chunk(s) [0]", secret=("all_gather",))
    _not_yet(ring("mean"), "divided by 2")
    _not_yet(ring("one_step_short"), "wrong sum on rank")
    _not_yet(ring("collective"), "launched collectives (all_reduce)")
    _not_yet(ring("stub"), "no ring yet")
    raised = ring("raises")
    _not_yet(raised, "no ring today")
    assert "second line" not in raised.message
    assert check("14-ring", _define(cluster, "def ring(tensor):\n    lesson.reference_ring(tensor)", "ring"),
                 cluster=cluster).ok                                          # the ranks still work


def test_the_reference_ddp_passes(cluster):
    verdict = check("14-ddp", _define(cluster, "Right = lesson.ReferenceDDP", "Right"), cluster=cluster)
    assert verdict.ok and "the first launched by the time gradient 1 of 29" in verdict.message, verdict


def test_wrong_ddps_hear_what_is_wrong(cluster):
    def ddp(kind):
        return check("14-ddp", _define(cluster, DDP[kind], "Wrong"), cluster=cluster)

    _not_yet(ddp("sum"), "2.00x torch DDP's", "averages over the 2 ranks")
    _not_yet(ddp("no_broadcast"), "rank 1's parameters differ from rank 0's", secret=("broadcast",))
    _not_yet(ddp("after_backward"), "after the last gradient was ready", secret=("all_reduce(",))
    _not_yet(ddp("no_sync_reduces"), "inside no_sync() your DDP still launched")
    _not_yet(ddp("no_sync_drops"), "after a no_sync() backward and a synced one", "must stay in .grad")
    _not_yet(ddp("stub"), "no DDP yet")
    _not_yet(check("14-ddp", "NotDefinedAnywhere", cluster=cluster), "is not defined on this rank")


def test_zero1(cluster):
    verdict = check("14-zero1", _define(cluster, "Right = lesson.ReferenceZeRO1", "Right"), cluster=cluster)
    assert verdict.ok and "adds up to plain AdamW's" in verdict.message, verdict

    def zero(kind):
        return check("14-zero1", _define(cluster, ZERO[kind], "Wrong"), cluster=cluster)

    _not_yet(zero("every_rank"), "2.00x plain AdamW's", "each parameter's state belongs on one rank")
    _not_yet(zero("no_broadcast"), "never changed", secret=("broadcast",))
    _not_yet(zero("no_average"), "averaged over all ranks", secret=("all_reduce",))
    _not_yet(zero("stub"), "no ZeRO-1 yet")


def test_the_bucket_rule_and_the_overlap_read_off_a_log():
    from fsdplab.lessons import build_ddp as lesson

    assert lesson.expected_buckets([10, 10, 10, 10, 5], 20) == 3          # 20, 20, and 5 left for finish()
    assert lesson.expected_buckets([30], 20) == 1 and lesson.expected_buckets([], 20) == 0
    events = [("ready",), ("ready",), ("all_reduce", 80), ("ready",), ("all_reduce", 40)]
    assert lesson.overlap(events) == {"gradients": 3, "launches": 2, "before_last_ready": 1, "ready_at_first": 2}
    late = [("ready",), ("ready",), ("all_reduce", 80), ("all_reduce", 40)]
    assert lesson.overlap(late)["before_last_ready"] == 0


def test_answers_written_another_way_pass(cluster):
    assert check("14-ring", _define(cluster, MINE["ring"], "ring"), cluster=cluster).ok
    assert check("14-ddp", _define(cluster, MINE["ddp"], "Mine"), cluster=cluster).ok
    assert check("14-zero1", _define(cluster, MINE["zero1"], "Mine"), cluster=cluster).ok


def test_section_4_prices_a_broadcast_at_the_chains_average():
    # a chain broadcast: every rank but the last forwards the tensor once, (N-1)/N of it per rank on average
    assert mean_sent_bytes("broadcast", 100, 2) == 50 and mean_sent_bytes("broadcast", 100, 4) == 75
    assert mean_sent_bytes("broadcast", 100, 1) == 0
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):     # the ring collectives are priced as before
        assert mean_sent_bytes(kind, 100, 4) == ring_sent_bytes(kind, 100, 4)
    records = [{"kind": "all_reduce", "tensor_bytes": 60, "group_size": 2},
               {"kind": "broadcast", "tensor_bytes": 60, "group_size": 2},
               {"kind": "broadcast", "tensor_bytes": 40, "group_size": 2}]
    sent = build_ddp.wire_sent(records)
    assert sent["all_reduce"] == {"count": 1, "sent": 60.0} and sent["broadcast"] == {"count": 2, "sent": 50.0}
    assert sent["all_gather"] == {"count": 0, "sent": 0}
    table = build_ddp.wire_table({"ZeRO-1": sent}, 100, 2)
    assert "2 ops,        50 B" in table and " x " not in table and table.endswith("1.10")
