"""The store a highly available control plane keeps its state in (issue 35): `etcd`, a
client of etcd's v3 JSON gateway on httpx under trio (leases, guarded transactions,
watches), on which the election and the stored state stand; `etcd_values`, the values it
hands out and their JSON."""
