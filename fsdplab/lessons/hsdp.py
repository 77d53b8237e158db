"""Lesson 07's code exercise, 07-hsdp: the learner's 2-D mesh and wrapping next to the lab's HSDP, on the ranks."""

from __future__ import annotations

import torch

from ..comms import CommCounter, make_mesh, toy_step
from .checkers import exercise, first_line, ranks_not_ready
from .scaling_out import node_layout


# --- the HSDP exercise: the learner's mesh and wrapping, run on the live ranks -------------------------------


def _units(model) -> list:
    """The FSDP units of `model`, by module path ("root" for the model itself), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [name or "root" for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _counted_step(model, cfg, batch_size: int, seed: int) -> dict:
    """On a rank: one warm-up training step of `model` (SGD), then one counted by a CommCounter. Returns the two
    losses, the counted collectives and the whole gradient of each parameter in the counted step."""
    from torch.distributed.tensor import DTensor

    from ..models import random_batch
    from ..ranks import this_rank
    from ..sharding import train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rank = this_rank()
    first = toy_step(model, optimizer, cfg, batch_size, seed + rank)
    grads = {}

    def keep():
        grads.update((name, p.grad) for name, p in model.named_parameters())

    batch = random_batch(cfg, batch_size, seed=seed + rank)
    with CommCounter() as counter:
        second = train_step(model, optimizer, batch, counter=counter, after_backward=keep).item()
    records = [{key: r[key] for key in ("kind", "ranks", "sent_bytes", "unit", "phase")} for r in counter.records]
    whole = {name: g.full_tensor() if isinstance(g, DTensor) else g for name, g in grads.items()}
    return {"losses": [first, second], "records": records, "grads": whole}


def compare_hsdp(hsdp_fn, layouts=(1,), cfg=None, batch_size: int = 2, seed: int = 0) -> list:
    """On a rank: for each ranks-per-node in `layouts`, the learner's `hsdp_fn(model, ranks_per_node)` on a
    fresh tiny transformer next to the lab's HSDP of it (`sharding.apply_fsdp` on the 2-D mesh (nodes,
    ranks_per_node), dims ("replicate", "shard")), one counted step each. Returns, per layout, the units and
    placements each made, the collectives each ran, the losses and each parameter's relative gradient error;
    it stops at the first layout where the learner's code raises."""
    from torch.distributed.tensor import DTensor

    from ..models import TinyConfig
    from ..ranks import device, this_rank, world_size
    from ..sharding import apply_fsdp, build_tiny

    cfg = cfg or TinyConfig(dim=32, num_layers=2)
    n, rank, out = world_size(), this_rank(), []
    for ranks_per_node in layouts:
        nodes = n // ranks_per_node
        lab = build_tiny(cfg, seed=seed, device=device())
        apply_fsdp(lab, make_mesh((nodes, ranks_per_node), ("replicate", "shard")))
        weight = lab.head.weight
        result = {"rank": rank, "world_size": n, "nodes": nodes, "ranks_per_node": ranks_per_node,
                  "blocks": [f"layers.{i}" for i in range(cfg.num_layers)], "lab_units": _units(lab),
                  "lab_placements": str(tuple(weight.placements)), "lab_mesh": weight.device_mesh.mesh.tolist()}
        out.append(result)
        lab_step = _counted_step(lab, cfg, batch_size, seed)
        result.update(lab_records=lab_step["records"], lab_losses=lab_step["losses"])
        model = build_tiny(cfg, seed=seed, device=device())
        try:
            returned = hsdp_fn(model, ranks_per_node)
        except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
            result["error"], returned = first_line(err), model
        result["units"] = _units(model)
        result["returned"] = "model" if returned is model else "None" if returned is None else type(returned).__name__
        params = dict(model.named_parameters())
        result["plain"] = [name for name, p in params.items() if not isinstance(p, DTensor)]
        # each distinct (placements, mesh) the learner's parameters sit on, with the first parameter on it
        seen = {}
        for name, p in params.items():
            if isinstance(p, DTensor):
                seen.setdefault((str(tuple(p.placements)), str(p.device_mesh.mesh.tolist())),
                                (name, str(tuple(p.placements)), p.device_mesh.mesh.tolist()))
        result["layouts"] = list(seen.values())
        if "error" in result:
            return out
        try:
            step = _counted_step(model, cfg, batch_size, seed)
        except Exception as err:  # noqa: BLE001 - the learner's model is the answer to show
            result["run_error"] = first_line(err)
            return out
        result.update(records=step["records"], losses=step["losses"], grad_errors={})
        for name, expected in lab_step["grads"].items():
            got = step["grads"].get(name)
            result["grad_errors"][name] = (float("inf") if got is None or expected is None else
                                           float((got - expected).norm() / expected.norm()))
    return out


def _groups(results: list, kind: str, lab: bool = False) -> list:
    """The rank groups a collective `kind` ran over, on any rank, sorted."""
    key = "lab_records" if lab else "records"
    return sorted({tuple(r["ranks"]) for x in results for r in x.get(key, []) if r["kind"] == kind})


def _groups_text(groups: list) -> str:
    """[(0, 1), (2, 3)] -> '[0, 1] and [2, 3]'."""
    names = [str(list(g)) for g in groups]
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "no ranks"


def _crosses(ranks, ranks_per_node: int) -> bool:
    """Whether a group of ranks spans more than one node (node = rank // ranks_per_node)."""
    return len({r // ranks_per_node for r in ranks}) > 1


def _between_nodes(results: list, ranks_per_node: int, lab: bool = False) -> float:
    """Bytes the counted step sent across the node boundary, whole job (ring model on the real groups)."""
    from ..comms import cross_node_bytes

    key = "lab_records" if lab else "records"
    return cross_node_bytes([r for x in results for r in x.get(key, [])], ranks_per_node)["inter"]


def _bytes_text(results: list, ranks_per_node: int) -> str:
    """'9,000 B per step between nodes (whole job), where the lab's HSDP sends 3,000 B'."""
    mine, lab = _between_nodes(results, ranks_per_node), _between_nodes(results, ranks_per_node, lab=True)
    if mine == lab:
        return f"{mine:,.0f} B per step between nodes (whole job), as many as the lab's HSDP sends here"
    return f"{mine:,.0f} B per step between nodes (whole job), where the lab's HSDP sends {lab:,.0f} B"


def _mesh_verdict(results: list, lesson=None) -> str | None:
    """What is wrong with the mesh and placements the learner's parameters sit on, or None when they are HSDP's.
    `lesson`: None at the lesson's own layout, else its (nodes, ranks per node) (the checker's message names
    the layout tried then)."""
    out = results[0]
    rpn, nodes, n = out["ranks_per_node"], out["nodes"], out["world_size"]
    if len(out["layouts"]) > 1:
        spots = "; ".join(f"{name} is {placements} over {mesh}" for name, placements, mesh in out["layouts"][:2])
        return f"your parameters sit on {len(out['layouts'])} different meshes ({spots}): put every unit on one mesh."
    _, placements, mesh = out["layouts"][0]
    if mesh == out["lab_mesh"] and placements == out["lab_placements"]:
        return None
    ring = _bytes_text(results, rpn)
    if mesh and not isinstance(mesh[0], list):               # a 1-D mesh
        if sorted(mesh) == list(range(n)):
            units = ("one unit for the whole model, gathered once a step" if out["units"] == ["root"]
                     else f"{len(out['units'])} units")
            return (f"your parameters are {placements} on a 1-D mesh of {'both' if n == 2 else f'all {n}'} ranks: "
                    f"plain FULL_SHARD over every rank (here {units}), whose all-gathers and reduce-scatters run "
                    f"over ranks {mesh}, across the nodes: {ring}. Make the mesh 2-D: replicate across nodes, "
                    "shard inside a node.")
        if not _crosses(mesh, rpn):
            meshes = sorted({tuple(x["layouts"][0][2]) for x in results if x["layouts"]})
            grads = [v for x in results for v in x.get("grad_errors", {}).values()]
            gap = f": they differ by up to {max(grads):.1e} (relative)" if grads else ""
            return (f"your parameters are {placements} on 1-D meshes of one node each ({_groups_text(meshes)}): "
                    "nothing is replicated across nodes, so no collective crossed the node boundary and each node "
                    f"averaged only its own ranks' gradients, where the lab's HSDP averages every rank's{gap}. "
                    "Shard every unit on the whole 2-D mesh.")
        return (f"your parameters are {placements} on a 1-D mesh of ranks {mesh}, across nodes: {ring}. Make the "
                "mesh 2-D: replicate across nodes, shard inside a node.")
    shape = (len(mesh), len(mesh[0]))
    where = (f"with {nodes} nodes x {rpn} rank(s) (node 0 is ranks {out['lab_mesh'][0]}), " if lesson is None else "")
    where += (f"your {shape[0]} x {shape[1]} mesh shards over ranks {mesh[0]} and replicates over ranks "
              f"{[row[0] for row in mesh]}")
    if mesh == out["lab_mesh"]:
        return f"{where}, as HSDP does, but your parameters are {placements}, not {out['lab_placements']}."
    if _crosses(mesh[0], rpn):
        hint = "The mesh's first dim"
        if shape == (rpn, nodes):
            same = (f" (at {lesson[0]} x {lesson[1]} both orders make the same mesh)"
                    if lesson and len(set(lesson)) == 1 else "")
            hint = f"Its dims are the wrong way round{same}: the first"
        return (f"{where}: its all-gathers and reduce-scatters cross the node boundary, {ring}. {hint} counts the "
                "nodes (replicate), the second the ranks of one node (shard).")
    return (f"{where}: it shards over {len(mesh[0])} rank(s) where a node has {rpn}, so a node's ranks keep copies "
            f"of the same shard and all-reduce them across nodes: {ring}. Shard over the ranks of a node, replicate "
            "across nodes.")


def _layout_verdict(results: list, lesson, rel: float) -> str | None:
    """What is wrong with the learner's HSDP at one layout (every rank's `compare_hsdp` entry), or None."""
    out = next((x for x in results if "error" in x or "run_error" in x), results[0])
    blocks, units, rpn = out["blocks"], out["units"], out["ranks_per_node"]
    missing = [b for b in blocks if b not in units]
    if "error" in out:
        if "root" in units and missing:
            return ("the root was wrapped before the blocks: its unit already held the blocks' parameters, and "
                    f"your function then raised {out['error']}")
        return f"your function raised on the ranks: {out['error']}"
    if not units:
        return "nothing was sharded: every parameter is still a plain tensor, whole on every rank."
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name in out["plain"]))
    if "root" not in units and owners:
        listed = " and ".join(filter(None, [", ".join(owners[:-1]), owners[-1]]))
        return f"the root was not wrapped: the parameters of {listed} are plain tensors, whole on every rank."
    if out["plain"]:
        return f"{', '.join(out['plain'])} stayed plain tensors, whole on every rank."
    wrong_mesh = _mesh_verdict(results, lesson)
    if wrong_mesh:
        return wrong_mesh
    if missing:
        what = ("only the root is an FSDP unit" if units == ["root"] else
                f"{len(missing)} of {len(blocks)} blocks ({', '.join(missing)}) are not FSDP units")
        gathered = [r["unit"] for r in out.get("records", []) if r["kind"] == "all_gather" and r["phase"] == "forward"]
        lab = [r["unit"] for r in out["lab_records"] if r["kind"] == "all_gather" and r["phase"] == "forward"]
        if lab:
            return (f"{what}: forward all-gathered {len(gathered)} unit(s) ({', '.join(gathered) or 'none'}) where "
                    f"the lab's HSDP gathers {len(lab)} ({', '.join(lab)}), one block at a time. Make each block a "
                    "unit of its own, then the root.")
        return (f"{what}: your units are {', '.join(units)}, the lab's HSDP's {', '.join(out['lab_units'])}. Make "
                "each block a unit of its own, then the root.")
    if "run_error" in out:
        return f"the sharded model raised in its training step: {out['run_error']}"
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        groups, lab_groups = _groups(results, kind), _groups(results, kind, lab=True)
        if groups != lab_groups:
            return (f"your step's {kind.replace('_', '-')}s ran over ranks {_groups_text(groups)}, the lab's HSDP's "
                    f"over {_groups_text(lab_groups)}: {_bytes_text(results, rpn)}.")
    if _between_nodes(results, rpn) != _between_nodes(results, rpn, lab=True):
        return (f"the collectives ran in the right groups, but {_bytes_text(results, rpn)}: they carried tensors of "
                "another size. Keep the model's fp32 parameters and gradients, as the lab's HSDP does.")
    worst = max(results, key=lambda x: max(abs(a - b) for a, b in zip(x["losses"], x["lab_losses"])))
    off = max(abs(a - b) for a, b in zip(worst["losses"], worst["lab_losses"]))
    if off > rel * max(1.0, *map(abs, worst["lab_losses"])):
        return (f"rank {worst['rank']}'s losses are {', '.join(f'{x:.6f}' for x in worst['losses'])}, the lab's HSDP "
                f"{', '.join(f'{x:.6f}' for x in worst['lab_losses'])}: leave the model's values and precision as "
                "they are.")
    name, error = max(((k, v) for x in results for k, v in x["grad_errors"].items()), key=lambda item: item[1])
    if error > rel:
        return (f"{name}'s gradient differs from the lab's HSDP's by {error:.1e} (relative): keep the parameters "
                "in fp32 and let FSDP average the gradients over every rank.")
    if out["returned"] != "model":
        return (f"your function shards the model but returns {out['returned']}: return the model it was given, "
                "which the training code goes on to use.")
    return None


@exercise("07-hsdp")
def _hsdp(answer, *, cluster, ranks_per_node: int = 2, cfg=None, rel: float = 1e-4):
    """The learner's `my_hsdp(model, ranks_per_node)` on every rank, on the tiny transformer of `cfg` (None: a
    smaller one), at the lesson's node layout and at one rank per node, next to the lab's HSDP in the same
    call: placements, units, the groups each collective ran in, the bytes that crossed the node boundary, then
    losses and gradients."""
    if not callable(answer):
        return False, f"expected a function my_hsdp(model, ranks_per_node) that shards the model, got {answer!r}."
    if cluster is None or cluster.world_size == 1:
        return False, ("with 1 rank there is one node: nothing is sharded or replicated, so which collectives "
                       "cross the node boundary, and their bytes, cannot be measured. Run the lesson with "
                       "world_size 2 or more (4 makes 2 nodes x 2).")
    if (not_ready := ranks_not_ready(cluster, "at its end")) is not None:
        return False, not_ready
    rpn = node_layout(cluster.world_size, ranks_per_node)["ranks_per_node"]
    layouts = [rpn] + ([1] if rpn > 1 else [])
    try:
        results = cluster.run(compare_hsdp, answer, layouts, cfg)
    except Exception as err:  # noqa: BLE001 - the learner's error is the answer to show
        return False, f"your function raised on the ranks: {str(err).strip().splitlines()[0]}"
    per_layout = [[x[i] for x in results if i < len(x)] for i in range(len(results[0]))]
    for i, at in enumerate(per_layout):
        lesson = (per_layout[0][0]["nodes"], rpn) if i else None
        wrong = _layout_verdict(at, lesson, rel)
        if wrong:
            if i:
                wrong = (f"right at {lesson[0]} nodes x {rpn} ranks, but the checker also calls my_hsdp(model, 1), "
                         f"{at[0]['nodes']} nodes x 1 rank: {wrong}")
            return False, wrong
    first = per_layout[0]
    out = first[0]
    worst = max(v for layout in per_layout for x in layout for v in x["grad_errors"].values())
    groups = ", ".join(f"{kind.replace('_', '-')}s over {_groups_text(_groups(first, kind))}"
                       for kind in ("all_gather", "reduce_scatter", "all_reduce") if _groups(first, kind))
    if not _groups(first, "all_gather"):
        groups += " (1 rank per node: nothing to gather or scatter inside a node)"
    also = f"; right at {per_layout[1][0]['nodes']} nodes x 1 rank too" if len(per_layout) > 1 else ""
    return True, (f"at {out['nodes']} nodes x {rpn} rank(s) your parameters are {out['lab_placements']} on the mesh "
                  f"{out['lab_mesh']}, as the lab's HSDP: {groups}; {_between_nodes(first, rpn):,.0f} B per step "
                  f"crossed the node boundary, as the lab's; losses and gradients match (worst relative error "
                  f"{worst:.1e}){also}.")
