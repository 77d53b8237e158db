"""`MemoryReport`: one rank's memory of one training setup, per category, as the formula, the fake-tensor
estimate and live measurement all give it; `CATEGORY_LABELS` names the six categories for people."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .._torch_private import CATEGORIES
from ..settings import GIB, MIB

CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
                   "activations": "activations", "communication_buffers": "communication buffers",
                   "other": "other (temporaries, buffers)"}


@dataclass
class MemoryReport:
    """Per-rank memory of one training setup. Bytes throughout."""

    peak_bytes: int
    by_category: dict
    world_size: int
    settings: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    source: str = "estimate"          # "formula", "estimate" (fake tensors) or "measure" (live ranks)
    resident: dict = field(default_factory=dict)   # steady-state sharded parameters / gradients / optimizer state
    detail: dict = field(default_factory=dict)     # the tracker's own categories at the peak, or formula terms
    category_peaks: dict = field(default_factory=dict)  # each category's own maximum over the step
    seconds: float = 0.0
    peak_moment: dict = field(default_factory=dict)   # where the step is at the peak: phase, module, op
    timeline: dict = field(default_factory=dict)      # bytes per category over the reported step, and the phase
    gpu_view: dict = field(default_factory=dict)      # reserved memory (allocator model) and nvidia-smi's view

    def fits(self, gpu_mem_gib: float, reserve_gib: float = 0.0) -> bool:
        """True if the peak fits in `gpu_mem_gib` GiB, keeping `reserve_gib` for the CUDA context and
        allocator fragmentation (which no estimate here includes)."""
        return self.peak_bytes <= (gpu_mem_gib - reserve_gib) * GIB

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryReport":
        return cls(**data)

    def phase_peaks(self) -> dict:
        """The highest bytes in each phase of the step (forward, backward, optimizer step, ...), from the timeline."""
        line, peaks = self.timeline, {}
        for i, phase in enumerate(line.get("phase", [])):
            total = sum(line[c][i] for c in CATEGORIES)
            peaks[phase] = max(peaks.get(phase, 0), total)
        return peaks

    def table(self, gpu_mem_gib: float | None = None) -> str:
        """A readable per-category table (GiB), the peak and, with `gpu_mem_gib`, whether it fits."""
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        lines = [f"per-rank memory ({self.source}), world size {self.world_size}", f"  {settings}", ""]
        width = max(len(v) for v in CATEGORY_LABELS.values())
        unit, div = ("GiB", GIB) if self.peak_bytes >= GIB / 4 else ("MiB", MIB)
        for name in CATEGORIES:
            value = self.by_category.get(name, 0)
            share = value / self.peak_bytes if self.peak_bytes else 0.0
            lines.append(f"  {CATEGORY_LABELS[name]:<{width}}  {value / div:9.3f} {unit}  {share:6.1%}")
        lines.append(f"  {'peak':<{width}}  {self.peak_bytes / div:9.3f} {unit}")
        if self.gpu_view:
            g = self.gpu_view
            lines.append(f"  on a GPU: reserved {g['reserved'] / div:.3f} {unit} (the caching allocator's segments; "
                         f"{g['reserved_expandable_segments'] / div:.3f} {unit} with expandable_segments), "
                         f"nvidia-smi about {g['nvidia_smi'] / div:.3f} {unit} (+ CUDA context "
                         f"{g['cuda_context'] / div:.2f} {unit}, {g['cuda_context_source']}; + NCCL "
                         f"{g['nccl'] / div:.2f} {unit}, {g['nccl_source']})")
            if g.get("offload"):
                lines.append(f"  on a GPU under cpu offload: {g['offload']}")
        if self.peak_moment:
            m = self.peak_moment
            lines.append(f"  peak at: {m.get('phase', '?')}" + (f", in {m['module']}" if m.get("module") else "")
                         + (f", op {m['op']}" if m.get("op") else ""))
            phases = {k: v for k, v in self.phase_peaks().items() if k in ("forward", "backward", "optimizer step")}
            if phases:
                lines.append("  highest per phase: " + ", ".join(f"{k} {v / div:.3f} {unit}"
                                                                 for k, v in phases.items()))
        if self.resident:
            lines.append("  resident shards: " + ", ".join(f"{k} {v / div:.3f} {unit}"
                                                          for k, v in self.resident.items()))
        if gpu_mem_gib is not None:
            verdict = "fits" if self.fits(gpu_mem_gib) else "does NOT fit"
            lines.append(f"  {verdict} in {gpu_mem_gib:g} GiB per GPU")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
