"""What a node reports when it registers: its hardware, the engines it can
launch, and the shards it is running.

Memory is in MiB, as integers: NVML counts bytes, but MiB is exact enough for
placement (profiles ask for whole GiB), stays readable in JSON and in the
simulated-inventory TOML, and never needs more than 53 bits.

Every class is frozen attrs with plain field types (str, int, tuples, dicts of
str, a StrEnum), so one cattrs converter can encode them as JSON unchanged.
"""

from __future__ import annotations

import enum

import attrs

from llmgw_core.catalog import LoraAdapter


@attrs.frozen
class Gpu:
    index: int  # the CUDA/NVML index on its node, what CUDA_VISIBLE_DEVICES names
    uuid: str
    name: str  # as NVML names it, such as "NVIDIA H100 80GB HBM3"
    memory_total_mib: int
    memory_free_mib: int  # when the inventory was taken


@attrs.frozen
class EngineInfo:
    """An engine the node's agent is configured for."""

    name: str  # vllm | sglang | llamacpp | mock
    found: bool  # the binary exists and ran for its version
    version: str = ""


@attrs.frozen
class Inventory:
    name: str
    # Where the router and the other ranks reach engines on this node; the
    # stream's peer address is no guide behind NAT. Empty means `name`.
    address: str = ""
    # Dicts are excluded from the hash so that a frozen Inventory stays hashable.
    labels: dict[str, str] = attrs.field(factory=dict, hash=False)
    # Fabric membership (ib_domain, nvlink_domain...) cannot be read off the
    # wire, so the agent's config declares it and it travels here.
    fabric: dict[str, str] = attrs.field(factory=dict, hash=False)
    cpus: int = 0
    memory_mib: int = 0
    gpus: tuple[Gpu, ...] = ()
    engines: tuple[EngineInfo, ...] = ()

    @property
    def host(self) -> str:
        return self.address or self.name

    def can_launch(self, engine: str) -> bool:
        return any(e.name == engine and e.found for e in self.engines)


class ShardState(enum.StrEnum):
    PENDING = "pending"  # accepted by the agent, not yet launched
    STARTING = "starting"  # the process runs, /health does not answer 200 yet
    READY = "ready"
    DRAINING = "draining"  # serving in-flight requests only, waiting to be stopped
    STOPPED = "stopped"
    FAILED = "failed"


@attrs.frozen
class LaunchSpec:
    """Everything an agent needs to start one shard, and what it reports back.

    The control plane chooses the ports, not the agent: the non-head ranks of a
    multi-node replica need the head's rendezvous port before any of them
    starts, and a spec the agent reports back at registration then carries
    everything a restarted control plane needs to adopt the shard.
    """

    replica_id: str
    model_name: str  # the name clients ask for; the engine serves under it
    engine: str
    hf_model: str  # the weights: a Hugging Face id or a local path
    args: tuple[str, ...]
    env: dict[str, str] = attrs.field(hash=False)
    tensor_parallel: int
    pipeline_parallel: int
    rank: int
    nodes: tuple[str, ...]  # the node of each rank; nodes[0] is the head
    gpu_indices: tuple[int, ...]  # this shard's GPUs on its own node
    head_address: str  # the head node's address, for the HTTP endpoint and rendezvous
    port: int  # the head's HTTP port
    dist_port: int  # the head's rendezvous port (used when the replica spans nodes)
    attempt: int = 0  # consecutive failures before this start; 0 for a fresh replica
    # The key the engine requires on every request (empty: none). It reaches the engine
    # through its environment, never its command line, and the router sends it.
    api_key: str = attrs.field(default="", repr=False)
    # The profile's max_model_len: the engine's context length (None: its own default).
    max_model_len: int | None = None
    # The profile's LoRA adapters, each served under its own name, and their highest rank
    # (None: the engine's default). An older control plane's spec has none.
    lora: tuple[LoraAdapter, ...] = ()
    max_lora_rank: int | None = None
    # The engine publishes its KV-cache events on port + 2 and answers replays on port +
    # 3 (the profile's kv_events); an older control plane's spec has none.
    kv_events: bool = False

    def __attrs_post_init__(self) -> None:
        # A spec travels over the wire: one that cannot describe a shard is refused at
        # decoding, before any decision is made on it.
        if not self.nodes or not 0 <= self.rank < len(self.nodes):
            raise ValueError(f"rank {self.rank} is not one of the {len(self.nodes)} nodes")
        if self.tensor_parallel < 1 or self.pipeline_parallel < 1:
            raise ValueError("parallel sizes must be at least 1")
        if not 0 < self.port < 65536 or not 0 <= self.dist_port < 65536:
            raise ValueError(f"port {self.port}/{self.dist_port} is not a TCP port")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len {self.max_model_len} is not a positive length")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank {self.max_lora_rank} is not a positive rank")
        names = [a.name for a in self.lora]
        if not all(names) or len(set(names)) != len(names):
            raise ValueError(f"the adapter names {names} must be distinct and not empty")

    @property
    def ports(self) -> tuple[int, ...]:
        """The ports the replica holds on its nodes: HTTP, rendezvous, and with kv_events
        the events' and their replay's."""
        width = 4 if self.kv_events else 2
        return tuple(range(self.port, self.port + width))

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def node(self) -> str:
        return self.nodes[self.rank]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def url(self) -> str:
        """The head's OpenAI-compatible root URL, what the router sends requests to."""
        host = f"[{self.head_address}]" if ":" in self.head_address else self.head_address
        return f"http://{host}:{self.port}"


@attrs.frozen
class ShardReport:
    """A shard as its agent sees it, sent at registration and on every transition."""

    spec: LaunchSpec
    state: ShardState
    detail: str = ""  # why it failed, with the engine's last output lines
