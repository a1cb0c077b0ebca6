"""The shard records the control plane knows, with the indexes every step reads.

All records go in and out through `add` and `remove`, the one place the indexes
(by replica, by model, by node) are kept, so that an event finds what it touches
without a pass over the fleet. A record's own fields (state, detail, when a
drain or stop was sent) change in place: no index depends on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from llmgw_core.inventory import LaunchSpec, ShardState
from llmgw_server.control.commands import Command, DrainShard, MarkNode, StartShard, StopShard
from llmgw_server.control.shards import ShardKey, ShardRecord
from llmgw_server.control.work import Work


class ShardStore:
    def __init__(self, work: Work) -> None:
        self.work = work
        self._records: dict[ShardKey, ShardRecord] = {}
        self._replicas: dict[str, dict[ShardKey, ShardRecord]] = {}
        self._models: dict[str, dict[str, None]] = {}  # model -> replica ids, in arrival order
        # node -> the replicas with a record on it or a rank placed on it (`spec.nodes`):
        # a change to the node may change how they are judged.
        self._touching: dict[str, set[str]] = {}
        self._nodes_of: dict[str, frozenset[str]] = {}
        self._model_of: dict[str, frozenset[str]] = {}
        # Replicas whose records changed since the reconciler last took them (for the
        # store a leader keeps: control.persisted); emptied every step.
        self.touched: set[str] = set()

    # -- the one place records change ---------------------------------------------

    def add(self, record: ShardRecord) -> None:
        """Add a record, replacing one with the same node, replica and rank. O(ranks)."""
        rid = record.spec.replica_id
        self.touched.add(rid)
        self._records[record.key] = record
        self._replicas.setdefault(rid, {})[record.key] = record
        self._reindex(rid)

    def remove(self, key: ShardKey) -> None:
        """O(ranks)."""
        record = self._records.pop(key)
        rid = record.spec.replica_id
        self.touched.add(rid)
        del self._replicas[rid][key]
        if not self._replicas[rid]:
            del self._replicas[rid]
        self._reindex(rid)

    def issued(self, command: Command, now: float) -> None:
        """Record a command sent: a started shard is pending, a drain or stop was sent."""
        if isinstance(command, StartShard):
            self.add(ShardRecord(command.node, command.spec, ShardState.PENDING))
        elif isinstance(command, DrainShard | StopShard):
            record = self._records[(command.node, command.replica_id, command.rank)]
            self.touched.add(command.replica_id)
            if isinstance(command, StopShard):
                record.stop_sent = True
            elif record.drain_at is None:
                record.drain_at = now
        else:
            assert isinstance(command, MarkNode)

    def _reindex(self, rid: str) -> None:
        records = self._replicas.get(rid, {}).values()
        nodes = frozenset(n for r in records for n in (r.node, *r.spec.nodes))
        models = frozenset(r.spec.model_name for r in records)
        for node in self._nodes_of.get(rid, frozenset()) - nodes:
            self._touching[node].discard(rid)
            if not self._touching[node]:
                del self._touching[node]
        for node in nodes:
            self._touching.setdefault(node, set()).add(rid)
        for model in self._model_of.get(rid, frozenset()) - models:
            del self._models[model][rid]
            if not self._models[model]:
                del self._models[model]
        for model in models:
            self._models.setdefault(model, {})[rid] = None
        if records:
            self._nodes_of[rid], self._model_of[rid] = nodes, models
        else:
            self._nodes_of.pop(rid, None)
            self._model_of.pop(rid, None)

    # -- reading ------------------------------------------------------------------

    def get(self, key: ShardKey) -> ShardRecord | None:
        return self._records.get(key)

    def __contains__(self, replica_id: str) -> bool:
        return replica_id in self._replicas

    def replica(self, replica_id: str) -> list[ShardRecord]:
        """A replica's records (none for one the store no longer knows). O(ranks)."""
        return list(self._replicas.get(replica_id, {}).values())

    def replicas(self) -> Iterator[tuple[str, list[ShardRecord]]]:
        """Every replica with its records. O(shards): for views, not for events."""
        for rid, records in self._replicas.items():
            yield rid, list(records.values())

    def models_of(self, replica_ids: Iterable[str]) -> set[str]:
        return {m for rid in replica_ids for m in self._model_of.get(rid, ())}

    def models(self) -> list[str]:
        """The models with a replica here."""
        return list(self._models)

    def of_model(self, model: str) -> list[str]:
        """The replicas of a model, oldest first. O(its replicas)."""
        return list(self._models.get(model, ()))

    def touching(self, node: str) -> set[str]:
        """The replicas with a record on `node` or a rank placed there. O(those)."""
        return set(self._touching.get(node, ()))

    def on_node(self, node: str) -> list[ShardRecord]:
        """The records on `node`. O(the replicas touching it)."""
        out = [r for rid in self._touching.get(node, ()) for r in self._replicas[rid].values()]
        self.work.shards += len(out)
        return [r for r in out if r.node == node]

    def used_gpus(self, node: str) -> frozenset[int]:
        """GPUs held on `node` by any shard, whatever its state."""
        return frozenset(i for r in self.on_node(node) for i in r.spec.gpu_indices)

    def head(self, replica_id: str) -> LaunchSpec | None:
        """The lowest-ranked shard's spec: every shard carries the replica's key and its
        head's address."""
        records = self._replicas.get(replica_id)
        if not records:
            return None
        return min(records.values(), key=lambda r: r.spec.rank).spec

    def ports(self, nodes: Iterable[str], *, ignore: str = "") -> Iterator[int]:
        """The ports held on these nodes by replicas other than `ignore`."""
        for node in nodes:
            for r in self.on_node(node):
                if r.spec.replica_id != ignore:
                    yield from r.spec.ports
