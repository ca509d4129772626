"""Use overlap from a PyTorch trainer: ``nn.Module`` stages, autograd backward, zero-copy.

    from overlap.torch import TorchPipeline
    with overlap.Runtime(Cluster.local(4)) as rt:       # or under torchrun / mpiexec
        pipe = TorchPipeline(make_stage, meshes, loss_fn=torch.nn.functional.mse_loss, rt=rt)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # this process's stages only
        opt.zero_grad()
        losses = pipe.train_step_sync(rt, x, y, num_microbatches=8, schedule="eager-1f1b")
        opt.step()

Profiling: ``with overlap.torch.profiler() as prof: ...`` records every runtime op as a
``record_function`` range (``prof.export_chrome_trace(f)``, then ``overlap trace report f``).

Needs PyTorch (``pip install -e '.[torch]'`` from the repository); ``import overlap`` alone
never imports it.
See :class:`TorchPipeline` for what runs where and :mod:`overlap.torch.tensors` for the
zero-copy crossings (CPU: shared numpy memory; CUDA: DLPack on the op's stream — run on one
H200). :func:`stage_backward_input` and :func:`stage_backward_weight` split a stage's backward
in two that cost one (what ``TorchPipeline`` runs for zb-h1 and zbv; for your own
``overlap.Stage`` functions too).
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (fail here, with the fix, not deep inside)
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "overlap.torch needs PyTorch: pip install torch==2.13.0 (the CPU wheel), "
        "then pip install -e '.[torch]' from the repository"
    ) from exc

from .auto_partition import AutoPartition, auto_partition, measure_layers
from .checkpoint import LoadResult
from .checkpoint_files import read_checkpoint
from .parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    TensorParallel,
    parallelize,
)
from .pipeline import LossFn, TorchPipeline, replicate
from .profiling import profiler
from .report import BoundaryReport
from .split_backward import stage_backward_input, stage_backward_weight
from .stages import LocalStage, build_stage
from .state_reshard import (
    TensorLayout,
    pipeline_shards,
    pipeline_state_layout,
    plan_state_dict,
    reshard_state_dict,
    tensor_parallel_layout,
    tensor_parallel_shards,
)

__all__ = ["AutoPartition", "BoundaryReport", "ColwiseParallel", "LoadResult", "LocalStage",
           "LossFn",
           "ParallelStyle",
           "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput",
           "Replicate", "RowwiseParallel", "SequenceParallel", "Shard", "TensorLayout",
           "TensorParallel",
           "TorchPipeline", "auto_partition", "build_stage", "measure_layers", "parallelize",
           "pipeline_shards", "pipeline_state_layout", "plan_state_dict", "profiler",
           "read_checkpoint", "replicate", "reshard_state_dict", "stage_backward_input",
           "stage_backward_weight", "tensor_parallel_layout", "tensor_parallel_shards"]
