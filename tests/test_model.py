"""Unit tests of the value types: Cluster, DeviceMesh, ShardingSpec, Sharding."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from scheduler import (
    Cluster,
    DeviceMesh,
    P,
    Replicate,
    Shard,
    Sharding,
    ShardingError,
    ShardingSpec,
)
from scheduler.sharding import split_bounds

# ---- Cluster ------------------------------------------------------------------------------


def test_cluster_defaults_and_derived_figures():
    c = Cluster(3, 4, nic_gbps=100)
    assert c.num_devices == 12
    assert c.num_nics == 3
    assert c.nics_per_host == 1
    assert c.nic_bytes_per_s == pytest.approx(100e9 / 8)
    assert c.nvlink_bytes_per_s == pytest.approx(640e9 / 8)
    assert c.nic_latency_s == pytest.approx(40e-6)
    assert c.nvlink_latency_s == pytest.approx(5e-6)
    assert isinstance(c.nic_gbps, float)


def test_cluster_host_major_devices():
    c = Cluster(3, 4, nic_gbps=10)
    assert [c.host_of(d) for d in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert list(c.devices_of_host(1)) == [4, 5, 6, 7]
    assert list(c.devices_of_host(2)) == [8, 9, 10, 11]


def test_preset_p3_8xlarge_figures():
    c = Cluster.preset("p3.8xlarge", 5)
    assert (c.num_hosts, c.gpus_per_host, c.nics_per_host) == (5, 4, 1)
    assert c.nic_gbps == 10.0
    assert c.nvlink_gbps == 640.0
    assert c.nic_latency_us == 40.0
    assert c.nvlink_latency_us == 5.0
    assert c.num_devices == 20
    # One NIC per host: every GPU of a host shares it.
    assert [c.nic_of(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_preset_dgx_h100_figures():
    c = Cluster.preset("dgx-h100", 2)
    assert (c.num_hosts, c.gpus_per_host, c.nics_per_host) == (2, 8, 8)
    assert c.nic_gbps == 400.0
    assert c.nvlink_gbps == 2960.0
    assert c.nic_latency_us == 5.0
    assert c.nvlink_latency_us == 3.0
    # One NIC per GPU: nic id == device id.
    assert [c.nic_of(d) for d in range(16)] == list(range(16))
    assert [c.host_of_nic(n) for n in range(16)] == [0] * 8 + [1] * 8


def test_preset_names():
    assert set(Cluster.preset_names()) == {"p3.8xlarge", "dgx-h100"}


def test_unknown_preset_names_it():
    with pytest.raises(ValueError, match="no-such-box"):
        Cluster.preset("no-such-box", 2)


def test_preset_validates_num_hosts():
    with pytest.raises(ValueError, match="num_hosts"):
        Cluster.preset("p3.8xlarge", 0)


def test_nic_of_two_nics_per_host():
    c = Cluster(2, 4, nic_gbps=10, nics_per_host=2)
    assert c.num_nics == 4
    assert [c.nic_of(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c.host_of_nic(n) for n in range(4)] == [0, 0, 1, 1]


def test_nic_of_eight_nics_on_eight_gpus():
    c = Cluster(3, 8, nic_gbps=400, nics_per_host=8)
    assert [c.nic_of(d) for d in range(24)] == list(range(24))


def test_nic_of_two_nics_on_eight_gpus():
    c = Cluster(2, 8, nic_gbps=400, nics_per_host=2)
    assert [c.nic_of(d) for d in range(16)] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4


@pytest.mark.parametrize("gpus, nics", [(4, 3), (8, 3), (6, 4), (2, 4)])
def test_nics_must_divide_gpus(gpus, nics):
    with pytest.raises(ValueError, match="nics_per_host"):
        Cluster(1, gpus, nic_gbps=10, nics_per_host=nics)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(num_hosts=0), ValueError, "num_hosts"),
        (dict(num_hosts=-1), ValueError, "num_hosts"),
        (dict(num_hosts=2.0), TypeError, "num_hosts"),
        (dict(num_hosts=True), TypeError, "num_hosts"),
        (dict(gpus_per_host=0), ValueError, "gpus_per_host"),
        (dict(nics_per_host=0), ValueError, "nics_per_host"),
        (dict(nic_gbps=0), ValueError, "nic_gbps"),
        (dict(nic_gbps=-5.0), ValueError, "nic_gbps"),
        (dict(nic_gbps=math.inf), ValueError, "nic_gbps"),
        (dict(nic_gbps=math.nan), ValueError, "nic_gbps"),
        (dict(nic_gbps="10"), TypeError, "nic_gbps"),
        (dict(nvlink_gbps=0), ValueError, "nvlink_gbps"),
        (dict(nic_latency_us=-1), ValueError, "nic_latency_us"),
        (dict(nvlink_latency_us=math.nan), ValueError, "nvlink_latency_us"),
    ],
)
def test_cluster_validation(kwargs, exc, name):
    args = dict(num_hosts=2, gpus_per_host=4, nic_gbps=10.0)
    args.update(kwargs)
    with pytest.raises(exc, match=name):
        Cluster(**args)


def test_zero_latency_is_allowed():
    c = Cluster(1, 1, nic_gbps=1, nic_latency_us=0, nvlink_latency_us=0)
    assert c.nic_latency_s == 0.0 and c.nvlink_latency_s == 0.0


def test_cluster_is_frozen_and_hashable():
    c = Cluster(2, 4, nic_gbps=10)
    with pytest.raises(AttributeError):
        c.num_hosts = 3  # type: ignore[misc]
    assert c == Cluster(2, 4, nic_gbps=10.0)
    assert hash(c) == hash(Cluster(2, 4, nic_gbps=10.0))
    assert c != Cluster(2, 4, nic_gbps=20.0)


def test_cluster_dict_round_trip():
    c = Cluster(2, 4, nic_gbps=25, nics_per_host=2, nvlink_gbps=300, nic_latency_us=7)
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_dict({"preset": "dgx-h100", "num_hosts": 3}) == Cluster.preset(
        "dgx-h100", 3
    )
    with pytest.raises(ValueError, match="bogus"):
        Cluster.from_dict({**c.to_dict(), "bogus": 1})


def test_cluster_mesh():
    c = Cluster(4, 2, nic_gbps=10)
    m = c.mesh([1, 3])
    assert m.shape == (2, 2)
    assert m.axis_names == ("host", "gpu")
    assert m.devices.tolist() == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match="hosts"):
        c.mesh([4])


def test_check_device():
    c = Cluster(2, 2, nic_gbps=10)
    assert c.check_device(3) == 3
    with pytest.raises(ValueError, match="src"):
        c.check_device(4, argument="src")
    with pytest.raises(TypeError):
        c.check_device(1.0)  # type: ignore[arg-type]


# ---- DeviceMesh ---------------------------------------------------------------------------


def test_mesh_basics():
    m = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("host", "gpu"))
    assert m.shape == (2, 4)
    assert m.axis_names == ("host", "gpu")
    assert m.axis_sizes == {"host": 2, "gpu": 4}
    assert m.size == 8
    assert m.device_ids == tuple(range(8))
    assert m.axis_index("gpu") == 1
    assert m.coords()[6] == (1, 2)
    assert isinstance(m.device_ids[0], int)


def test_mesh_single_axis_name_string():
    m = DeviceMesh([3, 1, 2], "x")
    assert m.axis_names == ("x",)
    assert m.shape == (3,)
    assert m.device_ids == (3, 1, 2)


def test_mesh_accepts_numpy_ints():
    m = DeviceMesh(np.arange(6).reshape(2, 3), ("a", "b"))
    assert m == DeviceMesh([[0, 1, 2], [3, 4, 5]], ("a", "b"))


def test_mesh_equality_and_hash():
    a = DeviceMesh([[0, 1], [2, 3]], ("host", "gpu"))
    b = DeviceMesh([[0, 1], [2, 3]], ("host", "gpu"))
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != DeviceMesh([[0, 1], [2, 3]], ("h", "g"))
    assert a != DeviceMesh([[0, 2], [1, 3]], ("host", "gpu"))
    assert a != DeviceMesh([0, 1, 2, 3], ("x",))
    assert a != DeviceMesh([[0, 1, 2, 3]], ("host", "gpu"))
    assert a != "not a mesh"


def test_mesh_devices_read_only():
    src = [[0, 1], [2, 3]]
    m = DeviceMesh(src, ("host", "gpu"))
    with pytest.raises(ValueError):
        m.devices[0, 0] = 9
    src[0][0] = 9  # the mesh does not alias its input
    assert m.devices[0, 0] == 0
    assert m.device_ids == (0, 1, 2, 3)


def test_mesh_repr_short():
    m = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("host", "gpu"))
    r = repr(m)
    assert "host=2" in r and "gpu=4" in r
    assert "0..7" in r
    big = DeviceMesh(np.arange(4096).reshape(512, 8), ("host", "gpu"))
    assert len(repr(big)) < 80
    assert "0..4095" in repr(big)
    odd = DeviceMesh([5, 2], "x")
    assert "5" in repr(odd) and "2" in repr(odd)


def test_mesh_dict_round_trip():
    m = DeviceMesh([[4, 6], [5, 7]], ("a", "b"))
    assert DeviceMesh.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_mesh_unknown_axis():
    m = DeviceMesh([0, 1], "x")
    with pytest.raises(ShardingError, match="'y'"):
        m.axis_index("y")


# ---- ShardingSpec -------------------------------------------------------------------------


def test_spec_canonicalizes_one_tuples():
    assert P(("host",)) == P("host")
    assert P(("host",)).entries == ("host",)
    assert P(["host", "gpu"]).entries == (("host", "gpu"),)
    assert P(()).entries == (None,)
    assert hash(P(("host",), None)) == hash(P("host"))


def test_spec_trailing_none_equality_and_hash():
    assert P("host", None, None) == P("host")
    assert hash(P("host", None, None)) == hash(P("host"))
    assert P() == P(None, None)
    assert P(None, "host") != P("host")
    assert P("host", "gpu") != P("gpu", "host")
    assert P(("host", "gpu")) != P(("gpu", "host"))
    assert len({P("a"), P("a", None), P(("a",))}) == 1


def test_spec_repr():
    assert repr(P("host", None)) == "P('host', None)"
    assert repr(P(("host", "gpu"), None)) == "P(('host', 'gpu'), None)"
    assert repr(P()) == "P()"


def test_spec_accessors():
    s = P("a", None, ("b", "c"))
    assert len(s) == 3
    assert list(s) == ["a", None, ("b", "c")]
    assert s[2] == ("b", "c")
    assert s.axes() == ("a", "b", "c")
    assert s.padded(5) == ("a", None, ("b", "c"), None, None)


def test_spec_json_round_trip():
    s = P("host", None, ("host2", "gpu"))
    data = s.to_json()
    assert data == ["host", None, ["host2", "gpu"]]
    back = ShardingSpec.from_json(json.loads(json.dumps(data)))
    assert back == s
    assert back.entries == s.entries


def test_sharding_json_round_trip():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("host", "gpu"))
    sh = Sharding(mesh, P(None, ("gpu", "host")))
    back = Sharding.from_json(json.loads(json.dumps(sh.to_json())))
    assert back == sh
    assert hash(back) == hash(sh)


def test_sharding_accepts_tuple_spec():
    mesh = DeviceMesh([0, 1], "x")
    assert Sharding(mesh, ("x", None)).spec == P("x")


# ---- DTensor placements -------------------------------------------------------------------

MESH_HG = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("host", "gpu"))


@pytest.mark.parametrize(
    "spec, placements",
    [
        (P(), (Replicate(), Replicate())),
        (P("host"), (Shard(0), Replicate())),
        (P(None, "gpu"), (Replicate(), Shard(1))),
        (P("gpu", "host"), (Shard(1), Shard(0))),
        (P(("host", "gpu")), (Shard(0), Shard(0))),
        (P(None, None, ("host", "gpu")), (Shard(2), Shard(2))),
    ],
)
def test_placements_round_trip(spec, placements):
    assert spec.to_placements(MESH_HG) == placements
    assert ShardingSpec.from_placements(list(placements), MESH_HG) == spec


def test_placements_multiple_axes_follow_mesh_order():
    # Several mesh axes on one dim nest major to minor in mesh-axis order.
    mesh = DeviceMesh([[0, 1], [2, 3]], ("gpu", "host"))
    assert ShardingSpec.from_placements([Shard(0), Shard(0)], mesh) == P(("gpu", "host"))
    assert ShardingSpec.from_placements([Shard(0), Shard(0)], MESH_HG) == P(("host", "gpu"))
    # Mixed: two axes on dim 1, none on dim 0.
    three = DeviceMesh(np.arange(8).reshape(2, 2, 2), ("a", "b", "c"))
    assert ShardingSpec.from_placements([Shard(1), Replicate(), Shard(1)], three) == P(
        None, ("a", "c")
    )
    assert P(None, ("a", "c")).to_placements(three) == (Shard(1), Replicate(), Shard(1))


def test_placements_duck_typed_torch_classes():
    class Shard:  # same class name as torch.distributed.tensor.Shard
        def __init__(self, dim):
            self.dim = dim

    class Replicate:
        pass

    spec = ShardingSpec.from_placements([Replicate(), Shard(1)], MESH_HG)
    assert spec == P(None, "gpu")


def test_placements_partial_is_type_error():
    class Partial:
        reduce_op = "sum"

    with pytest.raises(TypeError, match="'gpu'"):
        ShardingSpec.from_placements([Replicate(), Partial()], MESH_HG)


def test_placements_wrong_count():
    with pytest.raises(ValueError, match="placements"):
        ShardingSpec.from_placements([Replicate()], MESH_HG)


def test_placements_negative_dim():
    with pytest.raises(ValueError, match="placements"):
        ShardingSpec.from_placements([Shard(-1), Replicate()], MESH_HG)


def test_to_placements_unknown_axis():
    with pytest.raises(ShardingError, match="'tp'"):
        P("tp").to_placements(MESH_HG)


# ---- split rule and device regions --------------------------------------------------------


@pytest.mark.parametrize(
    "n, k, sizes",
    [
        (10, 4, [3, 3, 3, 1]),
        (5, 4, [2, 2, 1, 0]),
        (8, 4, [2, 2, 2, 2]),
        (1, 3, [1, 0, 0]),
        (0, 3, [0, 0, 0]),
        (7, 1, [7]),
        (9, 6, [2, 2, 2, 2, 1, 0]),
    ],
)
def test_split_bounds(n, k, sizes):
    bounds = [split_bounds(n, k, i) for i in range(k)]
    assert [b - a for a, b in bounds] == sizes
    # Consecutive, starting at 0, ending at n.
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, b0), (a1, _) in itertools.pairwise(bounds):
        assert b0 == a1


def test_device_regions_even():
    mesh = DeviceMesh([0, 1, 2, 3], "x")
    regions = Sharding(mesh, P("x")).device_regions((8, 3))
    assert regions == {
        0: ((0, 2), (0, 3)),
        1: ((2, 4), (0, 3)),
        2: ((4, 6), (0, 3)),
        3: ((6, 8), (0, 3)),
    }


def test_device_regions_uneven_10_over_4():
    mesh = DeviceMesh([0, 1, 2, 3], "x")
    regions = Sharding(mesh, P("x")).device_regions((10,))
    assert regions == {0: ((0, 3),), 1: ((3, 6),), 2: ((6, 9),), 3: ((9, 10),)}


def test_device_regions_uneven_5_over_4_has_empty_shard():
    mesh = DeviceMesh([7, 6, 5, 4], "x")
    regions = Sharding(mesh, P("x")).device_regions((5,))
    assert regions == {7: ((0, 2),), 6: ((2, 4),), 5: ((4, 5),), 4: ((5, 5),)}


def test_device_regions_second_dim():
    mesh = DeviceMesh([0, 1, 2], "x")
    regions = Sharding(mesh, P(None, "x")).device_regions((2, 7))
    assert regions == {0: ((0, 2), (0, 3)), 1: ((0, 2), (3, 6)), 2: ((0, 2), (6, 7))}


def test_device_regions_tuple_axes_major_to_minor():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("host", "gpu"))
    hg = Sharding(mesh, P(("host", "gpu"))).device_regions((8,))
    assert hg == {0: ((0, 2),), 1: ((2, 4),), 2: ((4, 6),), 3: ((6, 8),)}
    gh = Sharding(mesh, P(("gpu", "host"))).device_regions((8,))
    assert gh == {0: ((0, 2),), 2: ((2, 4),), 1: ((4, 6),), 3: ((6, 8),)}


def test_device_regions_tuple_axes_uneven():
    mesh = DeviceMesh([[0, 1, 2], [3, 4, 5]], ("host", "gpu"))
    regions = Sharding(mesh, P(("host", "gpu"))).device_regions((10,))
    # 10 over 6 ways: c = 2 -> 2,2,2,2,2,0
    assert [regions[d] for d in range(6)] == [
        ((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),), ((8, 10),), ((10, 10),)
    ]


def test_device_regions_two_dims_two_axes():
    mesh = DeviceMesh([[0, 1], [2, 3]], ("host", "gpu"))
    regions = Sharding(mesh, P("gpu", "host")).device_regions((4, 6))
    assert regions == {
        0: ((0, 2), (0, 3)),
        1: ((2, 4), (0, 3)),
        2: ((0, 2), (3, 6)),
        3: ((2, 4), (3, 6)),
    }


def test_device_regions_replicated_axis_shares_region():
    mesh = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("host", "gpu"))
    regions = Sharding(mesh, P("host")).device_regions((4, 6))
    for d in range(4):
        assert regions[d] == ((0, 2), (0, 6))
    for d in range(4, 8):
        assert regions[d] == ((2, 4), (0, 6))
    full = Sharding(mesh, P()).device_regions((4, 6))
    assert set(full.values()) == {((0, 4), (0, 6))}
    assert set(full) == set(range(8))


def test_device_regions_scalar_and_empty_shapes():
    mesh = DeviceMesh([0, 1], "x")
    assert Sharding(mesh, P()).device_regions(()) == {0: (), 1: ()}
    assert Sharding(mesh, P("x")).device_regions((0, 3)) == {
        0: ((0, 0), (0, 3)),
        1: ((0, 0), (0, 3)),
    }


def test_device_regions_tile_the_tensor():
    # Each element is held by exactly (number of devices / number of shards) devices.
    mesh = DeviceMesh(np.arange(12).reshape(2, 3, 2), ("a", "b", "c"))
    sh = Sharding(mesh, P("b", ("c", "a")))
    shape = (7, 5, 2)
    count = np.zeros(shape, dtype=int)
    for region in sh.device_regions(shape).values():
        count[tuple(slice(a, b) for a, b in region)] += 1
    assert (count == 1).all()


def test_num_shards():
    mesh = DeviceMesh(np.arange(12).reshape(2, 3, 2), ("a", "b", "c"))
    assert Sharding(mesh, P("b", ("c", "a"))).num_shards(3) == (3, 4, 1)


def test_to_placements_rejects_axes_against_mesh_order():
    # DTensor nests one dim's shards in mesh-axis order; ("gpu", "host") on a ("host", "gpu")
    # mesh would come back from from_placements as ("host", "gpu"), a different layout.
    with pytest.raises(ShardingError, match="against the mesh axis order"):
        P(("gpu", "host")).to_placements(MESH_HG)
    assert P(("host", "gpu")).to_placements(MESH_HG) == (Shard(0), Shard(0))


def test_cluster_mesh_first_gpus_of_each_host():
    c = Cluster(3, 4, nic_gbps=10)
    m = c.mesh([1, 2], gpus=2)
    assert m.devices.tolist() == [[4, 5], [8, 9]]
    assert c.mesh([0]).devices.tolist() == [[0, 1, 2, 3]]
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match="gpus"):
            c.mesh([0], gpus=bad)
