"""Lesson 13 (torch.compile with FSDP2) only: a compiler backend that counts the graphs it is given, the first
line of dynamo's reason for a graph break, the bytes autograd saves for backward, and the checker of the exercise
in which the learner removes a graph break from a block's forward, and what the lesson prints: its tables and
its summary.

What dynamo tells about graphs and breaks comes from its public API: `torch._dynamo.explain` (graphs, breaks
and their reasons) and a custom backend (any callable `backend(gm, example_inputs)` that torch.compile accepts,
here one that counts and hands the graph on to a named backend). tests/lessons/test_13_compile_fsdp2.py fails
loudly where a torch release changes what they say.
"""

from __future__ import annotations

import re

from .checkers import exercise, run_on_ranks

# The backend the lesson compiles with on CPU ranks. aot_eager traces forward and backward through AOTAutograd,
# as inductor does, and then runs the graphs with eager kernels: the graphs, breaks and the FSDP interplay are
# inductor's, the compile time a few seconds instead of about 20 (inductor's C++ codegen, timed on 2 CPU ranks).
CPU_BACKEND = "aot_eager"
GPU_BACKEND = "inductor"
# The block the exercise is about rescales its output when its largest value passes LIMIT; with TinyConfig's
# sizes and the checker's seeds the residual stream passes it in some blocks and not in others (1 of 2 on rank 0),
# so both sides of the branch are checked: a guard dropped, or one that always acts, changes the outputs.
LIMIT = 4.0
# The checker's seeds: the tiny model's weights, and each rank's batch (rank r: BATCH_SEED + r).
MODEL_SEED, BATCH_SEED = 0, 100


def pick_backend(device_type: str) -> str:
    """The backend for this lesson's ranks: inductor on GPUs, `CPU_BACKEND` on CPU ranks (see its comment)."""
    return GPU_BACKEND if device_type == "cuda" else CPU_BACKEND


# What the lesson counts as a graph's operations: calls of functions, of tensor methods (a block's `transpose`,
# `masked_fill_`) and of modules. `explain`'s own `op_count` counts the function calls only.
OP_NODES = ("call_function", "call_method", "call_module")


def graph_ops(gm) -> int:
    """The operations of one dynamo graph (an fx GraphModule): its nodes of the kinds in OP_NODES."""
    return sum(node.op in OP_NODES for node in gm.graph.nodes)


class GraphCounter:
    """A torch.compile backend that counts the graphs dynamo hands it, and their operations, then compiles each
    with the backend named `backend` ("aot_eager", "inductor", ...). Pass it as `torch.compile(m, backend=...)`.

    graphs: one entry per graph, the number of operations in it (`graph_ops`)."""

    def __init__(self, backend: str = CPU_BACKEND):
        import torch._dynamo

        self.backend = backend
        self._compile = torch._dynamo.lookup_backend(backend)
        self.graphs: list = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(graph_ops(gm))
        return self._compile(gm, example_inputs)

    @property
    def count(self) -> int:
        return len(self.graphs)

    @property
    def ops(self) -> int:
        return sum(self.graphs)


_SITE = re.compile(r"/\S+/site-packages/")      # an installed file's path, shown from the package's folder on


def _reason_parts(reason) -> tuple:
    """(first line, dynamo's "Explanation:" line or "") of a break reason, an exception, or its text."""
    text = str(getattr(reason, "reason", reason)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else "(no reason given)"
    if first.endswith(":") and len(lines) > 1:        # "... Skipped frames:" and the first of them
        first += " " + lines[1].lstrip("- ")
    explanation = next((line[len("Explanation:"):].strip().rstrip(".") for line in lines[1:]
                        if line.startswith("Explanation:")), "")
    return _SITE.sub("", first), _SITE.sub("", explanation)


def reason_line(reason) -> str:
    """The first line of a graph break's reason (an `explain` break reason, an exception, or its text), with
    dynamo's "Explanation:" line after it when there is one: what a learner needs, without the trace."""
    first, explanation = _reason_parts(reason)
    return f"{first} ({explanation})" if explanation else first


def explain(fn, *args) -> dict:
    """`torch._dynamo.explain(fn)(*args)` in plain data: graphs, breaks, operations (`graph_ops` of its graphs, as
    GraphCounter counts them), each break's reason line and the line of your code where it broke. Dynamo's caches
    are reset first, so that nothing compiled earlier hides a graph.

    breaks: the breaks explain gives a reason for. Its own `graph_break_count` is graphs - 1, which misses a
    break after the frame's last tensor operation (an `.item()` just before `return`): no graph follows it."""
    import torch
    import torch._dynamo

    torch.compiler.reset()
    found = torch._dynamo.explain(fn)(*args)
    frames = [r.user_stack[-1] if r.user_stack else None for r in found.break_reasons]
    return {"graphs": found.graph_count, "breaks": len(found.break_reasons),
            "ops": sum(graph_ops(gm) for gm in found.graphs),
            "reasons": [reason_line(r) for r in found.break_reasons],
            "where": [code_line(f.filename, f.lineno, f.line) if f is not None else "" for f in frames],
            "frames": [(f.filename, f.lineno) if f is not None else None for f in frames]}


def code_line(filename: str, lineno: int, line: str | None = None) -> str:
    """"`source line` (line N)", without its comment; the line read with linecache when not given (a rank has no
    source for a notebook cell's code, the notebook's kernel has). "" when no source is found."""
    import linecache

    text = (line or linecache.getline(filename, lineno)).strip()
    text = re.sub(r"\s+#.*$", "", text)
    return f"`{text}` (line {lineno})" if text else ""


def _fullgraph_exception(fn, *args, backend: str = CPU_BACKEND):
    import torch

    torch.compiler.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    except Exception as err:       # dynamo's Unsupported, or a backend's error: the reason is in the text
        return err
    finally:
        torch.compiler.reset()
    return None


def fullgraph_error(fn, *args, backend: str = CPU_BACKEND):
    """None when `torch.compile(fn, fullgraph=True)` runs `fn(*args)`, else the reason line of the error it
    raises: with fullgraph=True a graph break is an error that names the break."""
    err = _fullgraph_exception(fn, *args, backend=backend)
    return None if err is None else reason_line(err)


def error_line(fn):
    """None when `fn()` runs, else the reason line of what it raised (dynamo's caches reset before and after):
    a step with fullgraph=True somewhere fails at the first graph break there."""
    import torch

    torch.compiler.reset()
    try:
        fn()
    except Exception as err:       # dynamo's Unsupported and its kin: the reason is in the text
        return reason_line(err)
    finally:
        torch.compiler.reset()
    return None


def break_reason(fn, *args, backend: str = CPU_BACKEND, found: dict | None = None):
    """None when `fn(*args)` compiles into one graph, else one line: why dynamo broke the graph first, and at
    which line of your code. The words are dynamo's: its fullgraph=True error where that explains the break
    (a data-dependent branch), else `explain`'s reason (`explain` says only "generic_jump" for a branch;
    fullgraph=True turns an `.item()` into a symbolic guard error that hides the `.item()`). `found`: what
    `explain(fn, *args)` returned, when it ran already."""
    found = found or explain(fn, *args)
    if not found["breaks"]:
        return None
    first, explanation = _reason_parts(_fullgraph_exception(fn, *args, backend=backend) or "")
    said = f"{first} ({explanation})" if explanation else found["reasons"][0]
    return said + (f" at {found['where'][0]}" if found["where"][0] else "")


def _break_reason_and_frame(fn, *args, backend: str, found: dict) -> tuple:
    """(`break_reason`, the break's place as (file, line) when this process has no source for it, else None)."""
    if not found["breaks"]:
        return None, None
    said = break_reason(fn, *args, backend=backend, found=found)
    return said, (None if found["where"][0] else found["frames"][0])


def saved_for_backward(fn) -> dict:
    """Run `fn()` (a forward that returns a loss) with autograd's saved-tensor hooks and count what autograd
    holds for backward once the forward is done: tensors saved, and bytes of the distinct storages still
    allocated then. Then backward, which frees them.

    Counted after the forward, not as each tensor is saved: FSDP frees a block's gathered weights after its
    forward (their storages shrink to 0 bytes until backward gathers them again), so the weights a layer saves
    count only where FSDP keeps them (the root's); and all counted storages are alive at once, so no two share
    an address. Public API (torch.autograd.graph.saved_tensors_hooks); a compiled region's saved tensors pass
    through the same hooks."""
    import torch

    saved = []

    def pack(tensor):
        saved.append(tensor)       # the reference autograd keeps anyway
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = fn()
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    count = len(saved)
    saved.clear()
    loss.backward()
    return {"tensors": count, "bytes": sum(storages.values())}


def relative_gap(a, b) -> float:
    """Largest |a - b| / max(|b|, tiny) over two equal-length sequences of numbers (losses)."""
    a, b = [float(v) for v in a], [float(v) for v in b]
    if len(a) != len(b):
        raise ValueError(f"two runs of different length ({len(a)} and {len(b)} steps): run both with `steps` steps.")
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)), default=0.0)


# --- what the lesson prints ---------------------------------------------------------------------------------

def print_block_run(eager_losses, block_losses, *, loss_gap: float, graphs: list, num_layers: int,
                    first_s: float, compile_s: float, compiled_step: float, eager_step: float) -> None:
    """Print section 1's run: rank 0's losses step by step, eager and compiled per block, the largest gap, the
    graphs dynamo compiled, and the times (seconds; the steps' the slowest rank's median)."""
    print(f"{'step':>4} {'eager loss (rank 0)':>20} {'compiled loss':>14}")
    for step, (e, c) in enumerate(zip(eager_losses, block_losses)):
        print(f"{step:>4} {e:>20.6f} {c:>14.6f}")
    print(f"largest relative loss gap, any rank, any step: {loss_gap:.1e}")
    print(f"dynamo graphs: {len(graphs)} for {num_layers} blocks ({graphs} operations)")
    print(f"first compiled step {first_s:.2f} s: about {compile_s:.2f} s of compile; "
          f"later steps {compiled_step * 1e3:.0f} ms compiled, {eager_step * 1e3:.0f} ms eager "
          "(slowest rank's median)")


def print_places(counters: dict, first_s: dict, gaps: dict, strict: dict, explained: dict) -> None:
    """Print section 2's table (per place of torch.compile: graphs, operations, first step, loss gap, what
    fullgraph=True says), `explain`'s counts of the whole model sharded and unsharded, and the whole sharded
    model's fullgraph=True error."""
    print(f"{'where torch.compile goes':42} {'graphs':>6} {'operations':>10} {'1st step':>9} {'loss gap':>8}"
          "  fullgraph=True")
    for w in counters:
        said = "runs" if strict[w] is None else "fails: " + strict[w][:60] + "..."
        print(f"{w:42} {len(counters[w]):>6} {sum(counters[w]):>10} {first_s[w]:>7.2f} s {gaps[w]:>8.1e}  {said}")
    sharded, unsharded = explained["sharded"], explained["unsharded"]
    print(f"\nexplain, the whole sharded model: {sharded['graphs']} graph(s), {sharded['breaks']} break(s), "
          f"{sharded['ops']} operations; the same model unsharded: {unsharded['graphs']} graph(s), "
          f"{unsharded['breaks']} break(s), {unsharded['ops']} operations")
    print(f"\nfullgraph=True on the whole sharded model:\n  {strict[list(counters)[2]]}")


def summary(*, backend: str, steps: int, num_layers: int, block_graphs: list, loss_gap: float, compile_s: float,
            first_s: dict, counters: dict, strict: dict, explained: dict, planted: dict, planted_strict,
            saved: dict, change: float, tracker_error) -> str:
    """The lesson's summary in Markdown, from what its cells measured (named as the cells name them)."""
    order, after, whole_place = counters
    cold, warm = compile_s, first_s[order]      # the first compile in a fresh process, and again in a warm one
    sharded, unsharded = explained["sharded"], explained["unsharded"]
    whole, logged, fixed = counters[whole_place], planted["LoggedBlock"], planted["LoggedBlockFixed"]
    return f'''
## Summary

- **Compile each block, then shard** (torchtitan's order): {len(block_graphs)} graph of {block_graphs[0]} operations,
  compiled once for all {num_layers} blocks; `fullgraph=True` holds; the losses of {steps} steps equal eager's within
  {loss_gap:.1e} (relative, backend `{backend}`). The first compile in a fresh rank process took about {cold:.1f} s,
  the same compile again {warm:.1f} s for the whole first step.
- **Each block after `fully_shard`**: the same {len(counters[after])} graph, `fullgraph=True`
  {"holds" if strict[after] is None else "fails"}: `torch.compile(module)` runs the module's hooks outside dynamo.
- **The whole sharded model** compiles the same {len(whole)} graph of {sum(whole)} operations
  and no more: FSDP2's hooks are `torch._dynamo.disable`d, the first one breaks the root's forward inside its loop over
  the blocks, and dynamo runs that whole frame eager. `explain` reports {sharded['breaks']} breaks and
  {sharded['ops']} operations, against {unsharded['ops']} for the same model unsharded; `fullgraph=True`
  {"fails at the hook" if strict[whole_place] else "holds"}.
- **A graph break in a block** (`.item()` in `LoggedBlock`): {logged["graphs"]} graphs and
  {logged["breaks"]} break in `explain`; kept as a tensor: {fixed["graphs"]} graph,
  {fixed["breaks"]} breaks. With `fullgraph=True` the `.item()` version
  {"compiles: the flag does not catch this break" if planted_strict is None else "fails"}.
- **Memory held for backward** (rank 0, after one forward): eager {saved["eager"]["bytes"]:,} bytes in
  {saved["eager"]["tensors"]} tensors, `{backend}` {saved[backend]["bytes"]:,} in {saved[backend]["tensors"]},
  inductor's min-cut partitioner {saved["aot_eager_decomp_partition"]["bytes"]:,} in
  {saved["aot_eager_decomp_partition"]["tensors"]} (compiled against eager: {change:+.1%}). A compiled step's
  peak is not measured on CPU ranks: no allocator counter, and the memory tracker
  {"stops with dynamo's error on a compiled step" if tracker_error else "runs"}.
'''


# --- the exercise: a block without the graph break ----------------------------------------------------------

def _guarded_block_class():
    """The block of the exercise, as the lesson plants it (a Python branch on a tensor's value): the checker's
    reference, run in eager mode, where the branch costs nothing."""
    from ..models import Block

    class GuardedBlock(Block):
        limit = LIMIT
        rescaled = 0           # how many times this block rescaled (the checker reads it)

        def forward(self, x):
            x = super().forward(x)
            peak = x.abs().amax()
            if peak > self.limit:
                x = x * (self.limit / peak)
                self.rescaled += 1
            return x

    return GuardedBlock


def _tiny_with(block_class, cfg):
    """The tiny transformer with `block_class` blocks holding the same weights as `build_tiny(cfg, MODEL_SEED)`."""
    from ..ranks import device
    from ..sharding import build_tiny

    model = build_tiny(cfg, seed=MODEL_SEED, device=device())
    for name, block in model.layers.named_children():
        mine = block_class(cfg).to(block.norm1.weight.device)
        mine.load_state_dict(block.state_dict())
        model.layers.register_module(name, mine)
    return model


def _sharded(model, compile_backend=None):
    """Each block compiled (when `compile_backend`), then each block and the root sharded: the lesson's order."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from ..ranks import mesh

    if compile_backend is not None:
        for name, block in model.layers.named_children():
            model.layers.register_module(name, torch.compile(block, backend=compile_backend))
    for block in model.layers:
        fully_shard(block, mesh=mesh())
    fully_shard(model, mesh=mesh())
    return model


def try_block(block_class, *, dim: int = 64, num_layers: int = 2, seq_len: int = 32, batch_size: int = 4,
              backend: str = CPU_BACKEND) -> dict:
    """On a rank: the learner's block class against the planted one. Builds both tiny models (same weights),
    counts the graph breaks of one learner's block with `explain` on the real input of block 0 (and dynamo's
    reason, from fullgraph=True's error), and runs one forward and backward of each: the reference in eager
    mode, the learner's compiled block by block, then sharded. Returns plain data: breaks, graphs, the reason,
    the largest relative gap of the blocks' outputs and of the gradients, the reference's rescaled blocks."""
    import torch

    from ..models import TinyConfig, random_batch
    from ..ranks import rank
    from ..sharding import loss_of

    cfg = TinyConfig(dim=dim, num_layers=num_layers, seq_len=seq_len)
    tokens, targets = random_batch(cfg, batch_size=batch_size, seed=BATCH_SEED + rank())
    planted = _guarded_block_class()
    try:
        probe = _tiny_with(block_class, cfg)
    except Exception as err:
        return {"error": f"building the model with your class failed: {type(err).__name__}: {reason_line(err)}"}
    with torch.no_grad():
        first_input = probe.tok_emb(tokens) + probe.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
    try:
        found = explain(probe.layers[0], first_input)
        reason, frame = _break_reason_and_frame(probe.layers[0], first_input, backend=backend, found=found)
    except Exception as err:
        return {"error": f"your block raised under torch.compile: {type(err).__name__}: {reason_line(err)}"}

    results, rescaled = {}, 0
    torch.compiler.reset()
    for name, block_cls, compile_backend in (("reference", planted, None), ("yours", block_class, backend)):
        model = _sharded(_tiny_with(block_cls, cfg), compile_backend)
        outputs = []                # every block's output: the final LayerNorm would hide a block's scale
        hooks = [block.register_forward_hook(lambda module, args, out: outputs.append(out.detach().float()))
                 for block in model.layers]
        loss_of(model, (tokens, targets)).backward()      # the lab's loss: fp32 cross-entropy of the logits
        for hook in hooks:
            hook.remove()
        if name == "reference":
            rescaled = sum(block.rescaled for block in model.layers)
        grads = torch.cat([p.grad.to_local().flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (torch.cat([o.flatten() for o in outputs]), grads.detach().float())
    torch.compiler.reset()
    (ref_out, ref_grads), (my_out, my_grads) = results["reference"], results["yours"]

    def gap(mine, ref):
        if mine.shape != ref.shape:
            return float("inf")
        return float((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    return {"breaks": found["breaks"], "graphs": found["graphs"], "reason": reason, "frame": frame,
            "outputs_gap": gap(my_out, ref_out), "grads_gap": gap(my_grads, ref_grads),
            "rescaled": rescaled, "blocks": num_layers}


def block_verdict(results: list, tolerance: float) -> tuple:
    """(ok, message) from every rank's `try_block` result: breaks first, then the outputs, then the gradients."""
    first = results[0]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return False, errors[0]
    if first["breaks"]:
        n = first["breaks"]
        graphs = f" ({first['graphs']} graphs instead of 1)" if first["graphs"] > 1 else ""
        where = code_line(*first["frame"]) if first.get("frame") else ""     # the notebook's cell: read here
        said = (first["reason"] or "?") + (f" at {where}" if where else "")
        return False, (f"still {n} graph break{'s' if n != 1 else ''} in your block's forward{graphs}; dynamo "
                       f"says: {said}. "
                       "Compute the decision with tensor operations, not in Python.")
    outputs_gap = max(r["outputs_gap"] for r in results)
    if not outputs_gap <= tolerance:
        return False, (f"no graph break any more, but your blocks' outputs differ from the planted block's by "
                       f"{outputs_gap:.1e} (relative, tolerance {tolerance:.0e}); the reference rescaled "
                       f"{first['rescaled']} of {first['blocks']} blocks' outputs on rank 0: keep what the block "
                       "computes, change only how it decides.")
    grads_gap = max(r["grads_gap"] for r in results)
    if not grads_gap <= tolerance:
        return False, (f"no graph break and the same outputs, but the gradients differ from the planted block's by "
                       f"{grads_gap:.1e} (relative): does your rescale keep the gradient path through the peak?")
    return True, (f"1 graph per block, no break, and the outputs and gradients of the planted block on every rank "
                  f"(largest relative gap {max(outputs_gap, grads_gap):.1e}; {first['rescaled']} of "
                  f"{first['blocks']} blocks rescaled on rank 0).")


@exercise("13-graph-break")
def _graph_break(answer, *, cluster, backend: str | None = None, tolerance: float | None = None,
                 timeout: float = 120, **sizes):
    """The learner's block class, compiled block by block and sharded on the lesson's ranks, against the planted
    block in eager mode: no graph break in its forward, the same block outputs and gradients on every rank
    (within `tolerance`, relative: 1e-5 with aot_eager, which runs eager's kernels; 1e-3 with inductor's fused
    ones)."""
    import inspect

    if not inspect.isclass(answer):
        return False, ("expected your block class (class GuardedBlock(Block): ... with its forward), not an instance "
                       "or a function.")
    backend = backend or pick_backend("cuda" if cluster.backend == "nccl" else "cpu")
    tolerance = tolerance if tolerance is not None else 1e-5 if backend.startswith("aot_eager") else 1e-3
    results, why = run_on_ranks(cluster, try_block, answer, backend=backend, timeout=timeout, quiet=True,
                                what="your block", said=reason_line, **sizes)
    return (False, why) if why else block_verdict(results, tolerance)
