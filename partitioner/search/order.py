"""Device order: the pipeline orders of a cluster's devices that the planners search.

A cluster lists its devices in some order; the planners choose which device runs which stage. Devices
with equal speed and memory and equal links to every other device are *interchangeable* (swapping
two of them changes no cost), so the search enumerates orders of *device classes*, not of devices:

- :func:`device_classes` groups the interchangeable devices (first-listed first, members in listed order).
- :func:`candidate_orders` lists orders as sequences of classes: every distinct arrangement when there
  are at most ``max_orders`` of them (1 fast + 3 slow devices: 4 orders, the fast one anywhere in the
  chain), else each class kept in one contiguous run: the fastest runs first, then the runs permuted,
  cheapest links first (2 nodes x 8 GPUs: each crossing the slow inter-node link once). Orders alike
  in every cost (:func:`signature`) are listed once.
- A planner that may leave devices idle (the chain DP) reads every prefix of an order as a subset of
  1..K devices, so the subsets are enumerated by class too.

Metis (Um et al., "Metis: Fast automatic distributed training on heterogeneous GPUs", USENIX ATC 2024)
searches device-type orders along the pipeline the same way; :func:`fastest_on_heaviest` is its
"heaviest stage on the fastest device" rule, one of the CP-SAT path's candidates.

Example:
    >>> import partitioner as pt
    >>> fast = pt.Device("/GPU:0", memory="32GiB", flops_per_s=200e12)
    >>> slow = [pt.Device(f"/GPU:{i}", memory="16GiB", flops_per_s=50e12) for i in (1, 2, 3)]
    >>> cluster = pt.Cluster([fast, *slow])
    >>> device_classes(cluster)
    ((0,), (1, 2, 3))
    >>> candidate_orders(cluster)
    [(0, 1, 2, 3), (1, 0, 2, 3), (1, 2, 0, 3), (1, 2, 3, 0)]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from partitioner.cluster import Cluster, Device
from partitioner.errors import InputError

DEVICE_ORDERS = ("search", "given")
MAX_ORDERS = 24  # candidate orders at most: every class arrangement up to this many, else contiguous runs
MAX_PERMUTED_CLASSES = 7  # contiguous runs of up to this many classes are permuted (5040 orders ranked by links)


def check_device_order(device_order: object) -> None:
    """Raises InputError unless ``device_order`` is one of DEVICE_ORDERS."""
    if device_order not in DEVICE_ORDERS:
        raise InputError(
            f"device_order must be one of {DEVICE_ORDERS} ('search': the planner chooses which device runs "
            f"which stage; 'given': stages follow the cluster's order). Received: {device_order!r}."
        )


def interchangeable(cluster: Cluster, a: int, b: int) -> bool:
    """True iff devices ``a`` and ``b`` (indices) can swap places without changing any cost.

    They need the same speed and memory, the same link speed to and from every other device, and
    the same speed both ways between them.

    Example:
        >>> two_nodes = Cluster.from_json("2x8xH100-ib")
        >>> interchangeable(two_nodes, 0, 1), interchangeable(two_nodes, 0, 8)
        (True, False)
    """
    da, db = cluster.devices[a], cluster.devices[b]
    if _speeds(da) != _speeds(db) or da.memory_bytes != db.memory_bytes:
        return False
    if a != b and cluster.bandwidth(a, b) != cluster.bandwidth(b, a):
        return False
    others = (d for d in range(cluster.num_devices) if d not in (a, b))
    return all(
        cluster.bandwidth(a, d) == cluster.bandwidth(b, d) and cluster.bandwidth(d, a) == cluster.bandwidth(d, b)
        for d in others
    )


def device_classes(cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """The cluster's devices (indices) grouped into classes of interchangeable ones.

    Classes come in the order of their first device; each lists its devices in the cluster's order.
    Swaps of interchangeable devices compose, so comparing with a class's first device suffices.
    """
    classes: list[list[int]] = []
    for k in range(cluster.num_devices):
        home = next((c for c in classes if interchangeable(cluster, c[0], k)), None)
        if home is None:
            classes.append([k])
        else:
            home.append(k)
    return tuple(tuple(c) for c in classes)


def link_cost(cluster: Cluster, order: Sequence[int]) -> float:
    """Seconds per byte of sending one tensor along the whole chain ``order`` and its gradient back.

    What ranks orders by their links: a chain that crosses a slow link fewer times costs less.
    """
    return sum(1 / cluster.bandwidth(a, b) + 1 / cluster.bandwidth(b, a) for a, b in itertools.pairwise(order))


def _arrangements(counts: Sequence[int]) -> int:
    """How many distinct sequences of class labels there are with ``counts`` of each."""
    return math.factorial(sum(counts)) // math.prod(math.factorial(c) for c in counts)


def _label_sequences(counts: list[int]) -> list[tuple[int, ...]]:
    """Every distinct sequence with counts[c] copies of label c, in lexicographic order."""
    if not any(counts):
        return [()]
    result = []
    for c, left in enumerate(counts):
        if left:
            counts[c] -= 1
            result += [(c, *rest) for rest in _label_sequences(counts)]
            counts[c] += 1
    return result


def candidate_orders(cluster: Cluster, max_orders: int = MAX_ORDERS) -> list[tuple[int, ...]]:
    """Pipeline orders (tuples of device indices) worth planning on, the cluster's own order first.

    Every distinct arrangement of the device classes when there are at most ``max_orders``; else each
    class as one contiguous run: the fastest runs first, then the runs permuted (as listed and fastest
    first only, above MAX_PERMUTED_CLASSES classes), cheapest links first (:func:`link_cost`), at most
    ``max_orders`` in all. The k-th device of a class in an order is the k-th in the cluster's order,
    so the list is deterministic and a uniform cluster has exactly one order: its own.

    Raises:
        InputError: for a ``max_orders`` below 1.

    Example:
        >>> candidate_orders(Cluster.from_json("2x8xH100-ib"))  # the nodes listed either way round are alike
        [(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)]
    """
    if isinstance(max_orders, bool) or not isinstance(max_orders, int) or max_orders < 1:
        raise InputError(f"max_orders must be an integer >= 1. Received: {max_orders!r}.")
    classes = device_classes(cluster)
    label = {k: c for c, members in enumerate(classes) for k in members}
    given = tuple(label[k] for k in range(cluster.num_devices))
    counts = [len(c) for c in classes]
    if _arrangements(counts) <= max_orders:
        sequences = _label_sequences(counts)
    else:
        rank = {c: by_speed(cluster).index(members[0]) for c, members in enumerate(classes)}
        fastest_first = tuple(sorted(range(len(classes)), key=rank.__getitem__))
        if len(classes) <= MAX_PERMUTED_CLASSES:
            permutations = list(itertools.permutations(range(len(classes))))
        else:  # too many to permute: the runs as listed, and fastest first
            permutations = [tuple(range(len(classes))), fastest_first]
        runs = [tuple(c for c in p for _ in classes[c]) for p in permutations]
        ranked = sorted(runs, key=lambda s: (round(link_cost(cluster, _devices(classes, s)), 15), s))
        sequences = [tuple(c for c in fastest_first for _ in classes[c]), *ranked]
    return distinct(cluster, [_devices(classes, s) for s in [given, *sequences]])[:max_orders]


def _speeds(device: Device) -> tuple[object, ...]:
    """Every speed a device may run a model at: its rate, and its peaks per dtype times its efficiency,
    and its fixed cost per action (two devices equal here are equally fast for a model of any compute dtype)."""
    return (device.flops_per_s, device.peak_flops_per_s, device.efficiency, device.action_overhead_s)


def signature(cluster: Cluster, order: Sequence[int]) -> tuple[object, ...]:
    """What every cost depends on in a pipeline order: each position's speed and memory, and the link
    between every two positions. Two orders with one signature give the same plans."""
    devices = cluster.devices
    return (
        tuple((_speeds(devices[k]), devices[k].memory_bytes) for k in order),
        tuple(tuple(cluster.bandwidth(a, b) for b in order) for a in order),
    )


def distinct(cluster: Cluster, orders: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """``orders`` without those whose :func:`signature` an earlier one has (2 identical nodes listed
    either way round are one order)."""
    seen: set[tuple[object, ...]] = set()
    result = []
    for order in orders:
        key = signature(cluster, order)
        if key not in seen:
            seen.add(key)
            result.append(tuple(order))
    return result


def every_order_searched(cluster: Cluster, max_orders: int = MAX_ORDERS) -> bool:
    """True iff :func:`candidate_orders` lists every arrangement of the cluster's device classes.

    Example:
        >>> every_order_searched(Cluster.uniform(4, memory="1GiB"))
        True
        >>> every_order_searched(Cluster.from_json("2x8xH100-ib"))
        False
    """
    return _arrangements([len(c) for c in device_classes(cluster)]) <= max_orders


def _devices(classes: Sequence[Sequence[int]], labels: Sequence[int]) -> tuple[int, ...]:
    """The device order of a sequence of class labels (the k-th use of a class takes its k-th device)."""
    used = [0] * len(classes)
    order = []
    for c in labels:
        order.append(classes[c][used[c]])
        used[c] += 1
    return tuple(order)


def by_speed(cluster: Cluster) -> tuple[int, ...]:
    """Devices fastest first (then most memory, then as listed).

    Example:
        >>> by_speed(Cluster([Device("a", "1GiB", 1e12), Device("b", "1GiB", 4e12)]))
        (1, 0)
    """
    devices = cluster.devices
    return tuple(sorted(range(len(devices)), key=lambda k: (-devices[k].flops_per_s, -devices[k].memory_bytes, k)))


def fastest_on_heaviest(cluster: Cluster, stage_work: Sequence[float]) -> tuple[int, ...]:
    """Metis' rule: the stage with the most work runs on the fastest device, and so on down.

    Args:
        cluster: the devices.
        stage_work: the work (FLOPs or seconds on a common device) of each stage in pipeline order,
            at most one per device.

    Returns:
        A device order whose first ``len(stage_work)`` devices run those stages; idle devices follow,
        fastest first.

    Raises:
        InputError: when there are more stages than devices.

    Example:
        >>> fastest_on_heaviest(Cluster([Device("a", "1GiB", 1e12), Device("b", "1GiB", 4e12)]), [1.0, 3.0])
        (0, 1)
    """
    if len(stage_work) > cluster.num_devices:
        raise InputError(
            f"fastest_on_heaviest got {len(stage_work)} stages for {cluster.num_devices} devices; "
            "give at most one stage per device."
        )
    fastest = by_speed(cluster)
    heaviest = sorted(range(len(stage_work)), key=lambda s: (-stage_work[s], s))
    device_of = {s: fastest[rank] for rank, s in enumerate(heaviest)}
    return tuple(device_of[s] for s in range(len(stage_work))) + fastest[len(stage_work) :]


def fast_island(cluster: Cluster) -> tuple[int, ...] | None:
    """The devices (indices) of the cluster's first *island*, its devices joined by its fastest links
    (a link's speed: its slower direction), when the cluster has more than one island (a node of a
    multi-node cluster); else None.

    Example:
        >>> fast_island(Cluster.from_json("2x8xH100-ib"))
        (0, 1, 2, 3, 4, 5, 6, 7)
        >>> fast_island(Cluster.from_json("8xH100-nvlink")) is None
        True
    """
    num = cluster.num_devices
    if num < 2:
        return None

    def link(a: int, b: int) -> float:  # the slower direction
        return min(cluster.bandwidth(a, b), cluster.bandwidth(b, a))

    fastest = max(link(a, b) for a in range(num) for b in range(num) if a != b)
    island, frontier = {0}, [0]
    while frontier:
        a = frontier.pop()
        for b in range(num):
            if b not in island and link(a, b) >= fastest * (1 - 1e-9):
                island.add(b)
                frontier.append(b)
    return tuple(sorted(island)) if len(island) < num else None
