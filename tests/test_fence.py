"""The control plane's fence (issue 35): once its leadership ended, a plane carries out
nothing it decides, logs none of it as done, and says once that it held it back."""

from __future__ import annotations

import logging

import pytest

from llmgw_core.config import parse_config
from llmgw_server.control.commands import MarkNode
from llmgw_server.control.reconciler import Step
from llmgw_server.control_shell.controlplane import ControlPlane

CONFIG: dict[str, object] = {
    "agents": {"insecure": True},
    "models": [
        {
            "name": "m",
            "replicas": 1,
            "profile": {"engine": "vllm", "model": "org/m", "gpu_memory_gib": 20},
        }
    ],
}


async def test_a_plane_whose_leadership_ended_does_and_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    leading = [True]
    plane = ControlPlane(
        parse_config(CONFIG, "server.toml"),
        heartbeat_interval_s=1.0,
        epoch=7,
        may_act=lambda: leading[0],
    )
    sent: list[object] = []

    def send(node: str, message: object) -> bool:
        sent.append(message)
        return True

    plane.agents.send = send  # type: ignore[method-assign]
    step = Step(
        commands=(MarkNode("n1", cordoned=True, draining=False),),
        notes=("scaling m from 0 to 1 replicas: 1 request(s) held",),
    )
    caplog.set_level(logging.INFO, logger="llmgw.control")
    plane.apply(step)
    assert len(sent) == 1 and "scaling m from 0 to 1" in caplog.text
    caplog.clear()
    leading[0] = False  # the lease ran out (a pause past it)
    plane.apply(step)
    plane.apply(step)
    assert len(sent) == 1
    assert "scaling m" not in caplog.text
    assert caplog.text.count("leadership (epoch 7) ended") == 1
