"""Checks a launch spec against this node before anything starts.

An engine that refuses a profile does so after minutes of loading weights;
these checks take milliseconds and say exactly what is wrong.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Collection
from pathlib import Path

from llmgw_agent.adapters import KEY_OPTIONS, MULTI_NODE, given, is_hf_repo
from llmgw_core.engines import LORA_REFUSED, context_flag_in, lora_flag_in
from llmgw_core.inventory import Inventory, LaunchSpec


def problems(
    spec: LaunchSpec, inventory: Inventory, gpus_in_use: Collection[int], bind_host: str
) -> list[str]:
    """Every reason this node cannot start `spec`; empty when it can."""
    found: list[str] = []
    engine = next((e for e in inventory.engines if e.name == spec.engine), None)
    if engine is None:
        found.append(f"no {spec.engine} engine is configured on this node")
    elif not engine.found:
        found.append(f"the {spec.engine} engine cannot run here: {engine.version}")
    if spec.nnodes > 1 and spec.engine not in MULTI_NODE:
        found.append(f"{spec.engine} cannot span nodes")
    if spec.tensor_parallel < 1 or spec.pipeline_parallel < 1:
        found.append("parallel sizes must be at least 1")
    elif spec.nnodes > 1 and spec.nnodes != spec.pipeline_parallel:
        found.append(
            f"{spec.nnodes} nodes cannot hold pipeline_parallel={spec.pipeline_parallel}: "
            "pipeline stages run one per node"
        )
    want = spec.tensor_parallel * (spec.pipeline_parallel if spec.nnodes == 1 else 1)
    if len(spec.gpu_indices) != want:
        found.append(f"{len(spec.gpu_indices)} GPUs given where the parallel sizes need {want}")
    if not 0 <= spec.rank < spec.nnodes:
        found.append(f"rank {spec.rank} is outside the {spec.nnodes} nodes")
    present = {g.index for g in inventory.gpus}
    missing = sorted(set(spec.gpu_indices) - present)
    if missing:
        found.append(f"GPUs {missing} do not exist here (this node has {sorted(present)})")
    busy = sorted(set(spec.gpu_indices) & set(gpus_in_use))
    if busy:
        found.append(f"GPUs {busy} are in use by another shard")
    clash = [o for o in KEY_OPTIONS.get(spec.engine, ()) if given(spec.args, (o,))]
    if spec.api_key and clash:
        found.append(
            f"the profile's args set {', '.join(clash)}, which would replace the engine key "
            f"llmgw gives each replica (the router could no longer reach it): remove them"
        )
    twice = context_flag_in(spec.engine, spec.args)
    if spec.max_model_len is not None and twice is not None:
        # The catalog refuses such a profile; a spec from elsewhere is held to the same rule.
        found.append(
            f"the profile's args set {twice}, the context length that max_model_len "
            f"({spec.max_model_len}) already sets: give it once"
        )
    found += _lora_problems(spec)
    # llama.cpp takes a path for whatever is not an org/repo[:quant] (adapters.llamacpp).
    a_path = spec.hf_model.startswith(("/", "./", "../")) or (
        spec.engine == "llamacpp" and not is_hf_repo(spec.hf_model)
    )
    if a_path and not Path(spec.hf_model).exists():
        found.append(f"the model path {spec.hf_model} does not exist on this node")
    if spec.is_head:
        reason = port_taken(bind_host, spec.port)
        if reason:
            found.append(reason)
    return found


def _lora_problems(spec: LaunchSpec) -> list[str]:
    """The catalog's rules on adapters (catalog._lora_served), for a spec from elsewhere,
    and whether their paths exist here (a Hugging Face id is the engine's to fetch)."""
    if not spec.lora:
        return []
    refused = LORA_REFUSED.get(spec.engine)
    if refused is not None:
        return [f"{spec.engine} cannot serve LoRA adapters under their names: {refused}"]
    found = []
    twice = lora_flag_in(
        spec.engine, spec.args, adapters=True, rank=spec.max_lora_rank is not None
    )
    if twice is not None:
        found.append(
            f"the profile's args set {twice}, which the LoRA adapters llmgw passes already "
            "set: give them once"
        )
    for adapter in spec.lora:
        if adapter.path.startswith(("/", "./", "../")) and not Path(adapter.path).exists():
            found.append(f"the LoRA adapter path {adapter.path} does not exist on this node")
    return found


def port_taken(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is already in use on {host}"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None
