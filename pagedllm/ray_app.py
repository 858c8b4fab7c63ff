"""Ray Serve's entry point for PagedLLM: `serve run pagedllm.ray_app:app_builder model=... replicas=2`,
or `import_path: pagedllm.ray_app:app_builder` in a Serve config (KubeRay's RayService). The
args are `pagedllm serve`'s flags by name; the application is deploy/ray_serve.py's."""
from __future__ import annotations

from typing import Any

from .cli import build_parser, engine_config
from .deploy.ray_serve import application, scaling_of, server_options


def app_builder(args: dict[str, Any]):
    """`args`: `pagedllm serve`'s flags by name (model=..., replicas=2, max_num_seqs=64,
    kv_offload_url=...); true is a bare flag, false leaves it out."""
    argv = ["serve", "--ray"]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [] if v is False else [flag, str(v)]
    parsed = build_parser().parse_args(argv)
    return application(engine_config(parsed), server_options(parsed), scaling_of(parsed))
