"""Communication time of a training step, measured from the collectives themselves.

A sampled step runs under `torch.profiler`. Every collective leaves an interval in the trace: NCCL
kernels on the GPU (`ncclDevKernel_AllGather...`, `..._ReduceScatter...`, `..._AllReduce...`), gloo's
`gloo:all_gather` / `gloo:all_reduce` on gloo's worker threads (gloo runs a reduce-scatter as an
all-reduce). The compute the collectives can hide behind is the rest of the device's work: the other
GPU kernels, or on CPU the operators the training thread runs. The *exposed* communication is the part
of the union of collective intervals that no compute interval covers: the time the step waited for
the network. Nothing is synchronised outside the sampled steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

Interval = tuple[float, float]
# Gradient collectives (reduce-scatter, all-reduce) versus parameter all-gathers, by trace name.
GRADIENT_MARKERS = ("reducescatter", "reduce_scatter", "allreduce", "all_reduce")


@dataclass(frozen=True)
class CommTime:
    """Seconds of one profiled step."""

    total_s: float  # union of all collective intervals
    exposed_s: float  # of which no compute overlapped
    gradient_s: float  # union of the gradient collectives (reduce-scatter / all-reduce)
    gradient_exposed_s: float  # of which no compute overlapped


def union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def uncovered(intervals: list[Interval], cover: list[Interval]) -> float:
    """Length of the (merged) `intervals` not covered by the (merged) `cover`."""
    total, j = 0.0, 0
    for start, end in intervals:
        cursor = start
        while j < len(cover) and cover[j][1] <= cursor:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > cursor:
                total += cover[k][0] - cursor
            cursor = max(cursor, cover[k][1])
            k += 1
        total += max(0.0, end - cursor)
    return total


def is_collective(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith(("nccl", "gloo:"))


def is_gradient_collective(name: str) -> bool:
    lowered = name.lower()
    return any(marker in lowered for marker in GRADIENT_MARKERS)


def comm_time(events: Iterable, *, device_type: str) -> CommTime:
    """CommTime from profiler FunctionEvents (time ranges in microseconds)."""
    comm, grad, compute = [], [], []
    main_thread = None
    cpu_events = []
    for event in events:
        span = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        on_gpu = event.device_type == DeviceType.CUDA
        if is_collective(event.name) and (on_gpu or device_type != "cuda"):
            comm.append(span)
            if is_gradient_collective(event.name):
                grad.append(span)
        elif on_gpu:
            compute.append(span)
        elif device_type != "cuda" and event.name.startswith("aten::"):
            cpu_events.append((event.thread, span))
    if device_type != "cuda" and cpu_events:
        # The training thread is the one running the most operators; gloo's threads run none.
        counts: dict[int, int] = {}
        for thread, _ in cpu_events:
            counts[thread] = counts.get(thread, 0) + 1
        main_thread = max(counts, key=counts.get)
        compute = [span for thread, span in cpu_events if thread == main_thread]
    comm_u, grad_u, compute_u = union(comm), union(grad), union(compute)
    return CommTime(length(comm_u), uncovered(comm_u, compute_u), length(grad_u),
                    uncovered(grad_u, compute_u))


class StepProfiler:
    """`with StepProfiler(device) as p: step()` then `p.result`: the step's CommTime, `p.step_time_s`
    the step's device-synchronised wall time and `p.overhead_s` the profiler's own start, stop and
    trace processing around it (left out of the run's throughput)."""

    def __init__(self, device: torch.device):
        self.device = device
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self.result: CommTime | None = None
        self.step_time_s = 0.0
        self.overhead_s = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self) -> StepProfiler:
        self._sync()
        self._entered = time.perf_counter()
        self._profile.__enter__()
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        ended = time.perf_counter()
        self._profile.__exit__(*exc)
        if exc[0] is None:
            self.result = comm_time(self._profile.events(), device_type=self.device.type)
        self.step_time_s = ended - self._began
        self.overhead_s = time.perf_counter() - self._entered - self.step_time_s
