"""Checks that take milliseconds, run before a model that takes seconds to load, so a
typo'd port or device fails at once instead of after the weights are in memory."""
from __future__ import annotations

import socket


def check_port(host: str, port: int) -> None:
    """Raise ValueError unless (host, port) can be bound now.

    SO_REUSEADDR as uvicorn sets it, so a port left in TIME_WAIT by a previous run passes,
    while one that another process listens on fails, as it would when serving starts."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror}); is another server "
                             "running there? choose another with --port") from None


def check_device(device: str) -> None:
    """Raise ValueError if a CUDA device is asked for and is not there. auto and cpu
    always work, and need no torch import here."""
    if device in ("auto", "cpu"):
        return
    if not device.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    index = device.partition(":")[2]
    if index and not index.isdigit():
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"device {device!r}: no CUDA device is available (use --device cpu or auto)")
    if index and int(index) >= count:
        raise ValueError(f"device {device!r}: only {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
