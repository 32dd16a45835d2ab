"""Ray init arguments of a simulation: a local Ray instance, or an existing cluster, checked."""

from typing import Any

import grpc  # type: ignore[import-untyped]  # Flower's dependency, as is grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from edgefl.errors import EdgeFLError
from edgefl.settings import SimulationSettings

HEALTH_TIMEOUT_S = 5.0


def ray_init_args(sim: SimulationSettings) -> dict[str, Any]:
    """``init_args`` for Flower's Ray backend (passed to ``ray.init`` as they are).

    Without ``ray_address``: a local instance of ``ray_num_cpus`` CPUs. With it: join that
    cluster (Ray refuses ``num_cpus`` there: the cluster's nodes set them), once its head answered.

    Raises:
        EdgeFLError: no Ray head answers at ``ray_address``.
    """
    init_args: dict[str, Any] = {"logging_level": sim.flower_log_level}
    if sim.ray_address is None:
        init_args["num_cpus"] = sim.ray_num_cpus
        return init_args
    check_ray_head(sim.ray_address)
    init_args["address"] = sim.ray_address
    return init_args


def check_ray_head(address: str) -> None:
    """Raise unless a Ray head's GCS answers the standard gRPC health check at ``address``.

    ``ray.init`` retries a silent or wrong address for minutes; the health check answers at once.
    """
    with grpc.insecure_channel(address, [("grpc.enable_http_proxy", 0)]) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
            problem = None if reply.status == reply.SERVING else "not serving"
        except grpc.RpcError as exc:
            problem = exc.code().name
    if problem is not None:
        raise EdgeFLError(
            f"simulation.ray_address={address!r}: no Ray cluster head answers there "
            f"({problem}); start one with `ray start --head --port=6379` (`ray start "
            "--address=HEAD_IP:6379` on each worker) and pass its HOST:PORT, or set "
            "simulation.ray_address=null for a local Ray instance (docs/scale-out.md)"
        )
