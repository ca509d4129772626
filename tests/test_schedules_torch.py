"""Our schedules in torch.distributed.pipelining's action format, both ways (torch extra):
every schedule we make passes torch's own validator and its communication simulator, and
torch's own schedules read back as ours — valid, deadlock-free, simulated compute-only."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch==2.13.0")

from torch.distributed.pipelining import schedules as ts  # noqa: E402
from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: E402

from scheduler.schedules import (  # noqa: E402
    ALL_SCHEDULES,
    Schedule,
    compute_only_time,
    dependency_order,
    make_schedule,
)


def _sizes(name):
    for ranks in (1, 2, 3, 4):
        v = 2 if name in ("interleaved-1f1b", "zbv") else 1
        for m in range(1, 9):
            if name == "interleaved-1f1b" and m % ranks:
                continue
            yield make_schedule(name, ranks * v, m, stages_per_rank=v if v > 1 else None)


@pytest.mark.parametrize("name", ALL_SCHEDULES)
def test_every_schedule_we_make_passes_torchs_validator_and_comm_simulator(name):
    for sched in _sizes(name):
        rows = sched.to_torch_csv().strip().split("\r\n")
        actions = {r: [ts._Action.from_str(c) for c in row.split(",")]
                   for r, row in enumerate(rows)}
        ts._validate_schedule(actions, sched.num_ranks, sched.num_stages,
                              sched.num_microbatches)
        with_comms = ts._add_send_recv(actions, sched.rank_of, sched.num_stages)
        ts._simulate_comms_compute(with_comms, sched.rank_of, sched.num_stages)
        assert Schedule.from_torch_csv(sched.to_torch_csv()).actions == tuple(
            tuple(type(a)(a.kind, a.microbatch, sched.stage_of(r, a)) for a in acts)
            for r, acts in enumerate(sched.actions))


class _Stage(_PipelineStageBase):
    """Just what a torch schedule class reads of its stages to make its action lists."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = 0, group_size
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod, self.has_backward, self.dw_builder = None, True, None

    _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = (
        lambda *a, **k: None)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _torch_csv(cls, ranks: int, m: int, v_shape: bool) -> str:
    n = 2 * ranks
    stages = ([_Stage(0, n, ranks), _Stage(n - 1, n, ranks)] if v_shape
              else [_Stage(c * ranks, n, ranks) for c in range(2)])
    order = cls(stages, m).pipeline_order
    return "".join(",".join("" if a is None else str(a) for a in order[r]) + "\r\n"
                   for r in range(ranks))


@pytest.mark.parametrize("cls, v_shape", [
    (ts.ScheduleInterleaved1F1B, False), (ts.ScheduleLoopedBFS, False),
    (ts.ScheduleInterleavedZeroBubble, False), (ts.ScheduleZBVZeroBubble, True)])
@pytest.mark.parametrize("ranks, m", [(2, 4), (4, 8), (4, 12)])
def test_torchs_own_schedules_read_back_as_ours(cls, v_shape, ranks, m):
    sched = Schedule.from_torch_csv(_torch_csv(cls, ranks, m, v_shape), cls.__name__)
    assert (sched.num_ranks, sched.num_stages, sched.num_microbatches) == (ranks, 2 * ranks, m)
    assert sched.stages_per_rank == 2 and sched.placement == ("v" if v_shape else "loop")
    assert len(dependency_order(sched)) == sum(map(len, sched.actions))  # no deadlock
    makespan, bubble = compute_only_time(sched, {"F": 1.0, "I": 1.0, "W": 1.0})
    assert makespan >= 3 * m * 2 and 0 <= bubble < 1  # a rank computes 2 stages × m × 3
    if cls is ts.ScheduleZBVZeroBubble:  # ours: as short, within 2 units, at the same peak
        ours = make_schedule("zbv", 2 * ranks, m)
        assert compute_only_time(ours, {"F": 1.0, "I": 1.0, "W": 1.0})[0] <= makespan + 2
        assert max(map(ours.peak_rank_activations, range(ranks))) <= max(
            map(sched.peak_rank_activations, range(ranks)))
