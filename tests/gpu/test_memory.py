"""fsdplab.memory.estimate (fake tensors, on this machine's CPUs) against what one GPU really uses for the same
setting, for the 17 settings of memory_cases.py: allocated (torch.cuda.max_memory_allocated over
memory.measure_setting's steps, above what was allocated before), reserved (max_memory_reserved, against the
caching-allocator model) and the device's memory in use (mem_get_info's total - free, against "nvidia-smi about").
Each case prints and records measured vs estimated and the error; a case that does not fit in the GPU's free
memory is skipped with the numbers; fp16 replaces bf16 where the GPU has no native bf16.

The estimates run in CPU worker processes (fsdplab.memory.workers), all selected cases submitted at once, so
they go on while the rank measures the first cases."""

import gc
import os

import pytest
import torch

from fsdplab import memory
from fsdplab.memory.workers import Workers
from fsdplab.models import causal_lm, count_params
from fsdplab.settings import GIB

from . import memory_cases as mc


def _device_facts():
    """On the rank: compute capability and free memory of its GPU."""
    free, total = torch.cuda.mem_get_info()
    return {"capability": list(torch.cuda.get_device_capability()), "free": free, "total": total}


def _measured(setting):
    """On the rank: measure_setting (the package's build, sharding and steps, as the lessons measure), with the
    allocator's peaks over the same steps above what earlier cases left allocated (the estimate has no CUDA
    context, nor leftovers), and what the whole device has in use afterwards."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()      # max_memory_reserved from here: this case's segments only
    base = torch.cuda.memory_allocated()
    report = memory.measure_setting(setting, steps=3)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()   # before empty_cache: the segments the steps reserved still count
    out = {"tracker_peak": report.peak_bytes, "allocated_peak": torch.cuda.max_memory_allocated() - base,
           "reserved_peak": torch.cuda.max_memory_reserved(), "device_used": total - free,
           # beyond the allocator's segments: CUDA context, NCCL, cuBLAS workspaces
           "outside_allocator": (total - free) - torch.cuda.memory_reserved()}
    del report
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _selected(session, module_name) -> list:
    """The cases pytest will run in this module (after -k), in order: only those are estimated."""
    return [item.callspec.params["case"] for item in session.items
            if item.module.__name__ == module_name and hasattr(item, "callspec") and "case" in item.callspec.params]


@pytest.fixture(scope="module")
def device_facts(gpu_cluster):
    [facts] = gpu_cluster.run(_device_facts)
    return facts


@pytest.fixture(scope="module")
def estimates(request, device_facts):
    """{case: Future of its MemoryReport}, every selected case submitted at once to CPU workers."""
    cases = _selected(request.session, __name__)
    count = max(1, min(len(cases), 8, (os.cpu_count() or 2) - 2))
    workers = Workers(count)
    futures = {name: workers.submit(memory.estimate_here, mc.setting_of(name, device_facts["capability"]), False)
               for name in cases}
    yield futures
    workers.stop(wait=False)


def test_one_b_config_size():
    assert count_params(causal_lm(mc.one_b_config(), device="meta")) == mc.ONE_B_PARAMS


@pytest.mark.parametrize("case", list(mc.CASES))
def test_estimate_matches_gpu(case, gpu_cluster, device_facts, estimates, record):
    setting = mc.setting_of(case, device_facts["capability"])
    if setting != mc.setting_of(case):
        record("precision", f"{setting.precision} (compute capability {device_facts['capability']}: no native bf16)")
    estimate = estimates[case].result(timeout=600)
    [facts] = gpu_cluster.run(_device_facts)
    reason = mc.skip_reason(estimate.gpu_view, facts["free"])
    if reason:
        record("skipped", reason)
        pytest.skip(f"{case}: {reason}")
    [real] = gpu_cluster.run(_measured, setting, timeout=300)
    table = mc.rows(real, estimate)
    print(mc.line(case, table))
    for quantity, (measured, estimated, err) in table.items():
        record(f"{quantity}_gib", round(measured / GIB, 3))
        record(f"{quantity}_est_gib", round(estimated / GIB, 3))
        record(f"{quantity}_err", f"{err:+.2%}")
    record("tracker_peak_gib", round(real["tracker_peak"] / GIB, 3))
    record("outside_allocator_gib", round(real["outside_allocator"] / GIB, 3))
    record("estimate_seconds", estimate.seconds)
    wrong = {k: f"{err:+.1%} (bound {mc.TOLERANCE[k]:.0%})" for k, (_, _, err) in table.items()
             if abs(err) > mc.TOLERANCE[k]}
    assert not wrong, f"{case}: measured / estimated - 1 past its bound: {wrong}\n{mc.line(case, table)}"
