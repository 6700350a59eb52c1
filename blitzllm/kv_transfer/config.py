"""``--kv-transfer-config``: the role of an engine in prefill/decode disaggregation, with
vLLM's key names where they apply. Parsing and validation only; knows nothing about
engines, tensors or HTTP.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Union

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)
POLICIES = ("recompute", "fail")
_KEYS = {"kv_role", "kv_connector", "kv_connector_extra_config", "kv_lease_s", "kv_load_failure_policy",
         "kv_ip", "kv_port", "engine_id", "kv_transfer_timeout_s"}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "NixlConnector"      # the default transport (NIXL over UCX)
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_lease_s: float = 30.0                 # a producer frees blocks no consumer claimed after this
    kv_load_failure_policy: str = "recompute"  # a consumer whose pull fails: recompute | fail (503)
    kv_ip: str = "127.0.0.1"                 # where consumers reach this engine's control plane (HTTP)
    kv_port: int = 0                         # (blitz serve fills in its --host / --port)
    engine_id: Optional[str] = None          # default: a fresh id per start
    kv_transfer_timeout_s: float = 10.0      # one pull (claim + read), never longer

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def with_address(self, host: str, port: int) -> "KVTransferConfig":
        """The address consumers use, unless the config names one (0.0.0.0 means loopback)."""
        ip = self.kv_ip if self.kv_ip != "127.0.0.1" else ("127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
        return replace(self, kv_ip=ip, kv_port=self.kv_port or port)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_kv_transfer_config(value: Union[None, str, dict, KVTransferConfig]) -> Optional[KVTransferConfig]:
    """A JSON string or dict -> ``KVTransferConfig``; ValueError naming the bad key."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_transfer_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("kv_transfer_config must be a JSON object")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_config has unknown keys {unknown}; known: {sorted(_KEYS)}")
    v = dict(value)
    extra = v.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config kv_connector_extra_config must be an object")
    # the lease and the policy may also sit in the extra config (where vLLM's connectors read theirs)
    for k in ("kv_lease_s", "kv_load_failure_policy", "kv_transfer_timeout_s"):
        if k in extra and k not in v:
            v[k] = extra[k]
    role = v.get("kv_role")
    if role not in ROLES:
        raise ValueError(f"kv_transfer_config kv_role must be one of {list(ROLES)}, got {role!r}")
    conn = v.get("kv_connector") or "NixlConnector"
    if conn not in CONNECTORS:
        raise ValueError(f"kv_transfer_config kv_connector must be one of {list(CONNECTORS)} (or left out), got {conn!r}")
    policy = v.get("kv_load_failure_policy") or "recompute"
    if policy not in POLICIES:
        raise ValueError(f"kv_transfer_config kv_load_failure_policy must be one of {list(POLICIES)}, got {policy!r}")
    out = {}
    for k in ("kv_lease_s", "kv_transfer_timeout_s"):
        if k in v:
            x = v[k]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0:
                raise ValueError(f"kv_transfer_config {k} must be a number > 0, got {x!r}")
            out[k] = float(x)
    port = v.get("kv_port", 0)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"kv_transfer_config kv_port must be an integer in [0, 65535], got {port!r}")
    return KVTransferConfig(kv_role=role, kv_connector=conn, kv_connector_extra_config=extra,
                            kv_load_failure_policy=policy, kv_ip=str(v.get("kv_ip") or "127.0.0.1"), kv_port=port,
                            engine_id=v.get("engine_id"), **out)
