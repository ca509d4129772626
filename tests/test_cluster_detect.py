"""``Cluster.detect``: the devices a job really has, from its launcher's variables and the
GPUs this host shows (no process is contacted, nothing is measured)."""

from __future__ import annotations

import pytest

from scheduler import Cluster


@pytest.mark.parametrize("env, hosts, per_host", [
    ({}, 1, 1),                                                        # alone, no GPU
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 2, 4),              # torchrun, 2 nodes
    ({"PMI_SIZE": "6", "MPI_LOCALNRANKS": "3", "PMI_RANK": "0"}, 2, 3),  # mpiexec (hydra)
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 1, 4),
    ({"SLURM_NNODES": "3", "SLURM_NTASKS": "6"}, 3, 2),
])
def test_without_gpus_each_process_of_the_job_is_one_virtual_device(env, hosts, per_host):
    c = Cluster.detect({**env, "CUDA_VISIBLE_DEVICES": ""})
    assert (c.num_hosts, c.gpus_per_host) == (hosts, per_host)
    assert c.nvlink_gbps == Cluster.local(1).nvlink_gbps


def test_visible_gpus_of_every_host_with_the_link_figures_of_a_preset():
    c = Cluster.detect({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"})
    h100 = Cluster.preset("dgx-h100", 2)
    assert c == h100  # 2 hosts × 8 GPUs, DGX H100 links
    one = Cluster.detect({"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb,-1,3"}, like="p3.8xlarge")
    assert (one.num_devices, one.nic_gbps, one.nics_per_host) == (2, 10.0, 1)
    # A task bound to one GPU of its node (srun --gpus-per-task=1): the node has 4.
    bound = Cluster.detect({"SLURM_NNODES": "2", "SLURM_NTASKS": "8",
                            "CUDA_VISIBLE_DEVICES": "0"})
    assert (bound.num_hosts, bound.gpus_per_host) == (2, 4)


@pytest.mark.parametrize("env, like, match", [
    ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "dgx-h100", r"WORLD_SIZE=6 processes are "
                                                               r"not whole hosts"),
    ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "4"}, "dgx-h100", r"WORLD_SIZE: expected an int"),
    ({"SLURM_NNODES": "2", "SLURM_NTASKS": "3"}, "dgx-h100", r"SLURM_NTASKS=3 tasks"),
    ({"CUDA_VISIBLE_DEVICES": "0"}, "tpu-pod", r"like: unknown cluster preset 'tpu-pod'"),
])
def test_what_cannot_be_a_cluster_is_named(env, like, match):
    with pytest.raises(ValueError, match=match):
        Cluster.detect(env, like=like)
