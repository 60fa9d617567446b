"""Replicas of the sparrow server on Ray Serve, behind Ray Serve's HTTP proxy.

Each replica is one Ray actor running a whole `sparrow serve` app (sparrow.server.app): its own
model, engine thread and continuous batching, with the same endpoints. Ray Serve routes the
requests (its default router sends each to the replica with fewer requests in flight), restarts
replicas that die, and scales between min and max replicas when autoscaling is on. Nothing here
routes or batches: a replica is exactly a single server.

- `sparrow serve --ray [--replicas N | --min-replicas A --max-replicas B] [--replica-cpus C]
  [--ray-address auto|ADDRESS]`: starts (or joins) a Ray cluster and serves on --host/--port.
- `serve run sparrow.server.ray_serve:app_builder model=PATH replicas=2 replica_cpus=1 ...`:
  the same application from Ray's own CLI or a config file (arguments as in `sparrow serve`,
  with underscores).

A replica declares `num_cpus` (--replica-cpus) and runs that many compute threads, so Ray
places no more replicas on a machine than its cores can run. It reports ready only once its
model has loaded and its warm-up step has run (the ASGI app is built, model included, when the
replica starts), and its health check fails if the engine thread has died.
Ray is an optional extra: pip install 'sparrow[ray]'.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..config import rope_scaling_from_flags
from ..errors import SparrowError
from ..vision.media import MAX_PIXELS_PER_REQUEST
from .app import create_app, load_options, state_from_args
from .limits import BODY_TIMEOUT

_REPLICA: dict = {}  # this process's ServerState (Ray runs each replica in its own actor process)
READY_TIMEOUT_S = 900.0  # model load + kernel compile on a cold cache (a few minutes at worst)

# `sparrow serve` arguments a replica uses, with their defaults (for app_builder's dict)
SERVE_DEFAULTS = dict(
    model=None,
    mmproj=None,
    ctx=None,
    rope_scaling=None,
    rope_scale=None,
    yarn_orig_ctx=None,
    kv_dtype="f32",
    quantize=None,
    activations=None,
    api_key=None,
    max_batch=16,
    kv_budget=None,
    max_queue=None,
    request_timeout=None,
    no_prefix_cache=False,
    prompt_cache=None,
    prompt_cache_size=None,
    allowed_local_media_path=None,
    max_images_per_request=None,
    max_image_file_size=None,
    max_pixels_per_request=MAX_PIXELS_PER_REQUEST,
    metrics_public=False,
    no_web_ui=False,
    allow_special_tokens_in_content=False,
    body_timeout=BODY_TIMEOUT,
)


def _build_app(options: dict):
    """The replica's ASGI app, returned once the model is loaded and warmed up (Ray Serve calls
    this when the replica starts, so the replica is ready exactly when the server is)."""
    from .. import api

    args = argparse.Namespace(**options)
    state = state_from_args(args)
    state.attach(api.load(**load_options(args)))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not state.ready:
        if not state.engine.alive() or time.monotonic() > deadline:
            raise SparrowError("sparrow replica: the engine did not become ready")
        time.sleep(0.05)
    _REPLICA["state"] = state
    print(f"sparrow replica {os.getpid()}: {state.llm.name} ready, {state.llm.threads} threads", file=sys.stderr)
    return create_app(state)


def _check_health() -> None:
    # module level, so the deployment class (pickled by value) reaches this module's _REPLICA
    state = _REPLICA.get("state")
    if state is None or not state.engine.alive():
        raise RuntimeError("sparrow replica: engine thread is not running")


def deployment(options: dict, replicas: int = 1, replica_cpus: float = 1, autoscaling: dict | None = None):
    """A bound Ray Serve application of sparrow replicas. options: `sparrow serve`'s arguments
    (SERVE_DEFAULTS' names); autoscaling: Ray Serve's autoscaling_config (min_replicas,
    max_replicas, target_ongoing_requests, ...), which replaces the fixed replica count."""
    from ray import serve

    options = {**SERVE_DEFAULTS, **options, "threads": max(1, int(replica_cpus))}
    scale = {"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}

    @serve.deployment(
        name="sparrow",
        ray_actor_options={"num_cpus": replica_cpus},
        health_check_period_s=5,
        health_check_timeout_s=30,
        max_ongoing_requests=4 * options["max_batch"],  # the rest waits at the proxy, not in a replica
        **scale,
    )
    @serve.ingress(lambda: _build_app(options))
    class Sparrow:
        def check_health(self):
            _check_health()

    return Sparrow.bind()


def _autoscaling(min_replicas, max_replicas, target) -> dict | None:
    if min_replicas is None and max_replicas is None:
        return None
    lo = 1 if min_replicas is None else int(min_replicas)
    hi = max(lo, lo if max_replicas is None else int(max_replicas))
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": float(target or 8)}


def app_builder(args: dict):
    """`serve run sparrow.server.ray_serve:app_builder key=value ...` (strings, as Ray passes them)."""
    args = dict(args)
    num = lambda k, f, d=None: f(args.pop(k)) if k in args else d  # noqa: E731
    replicas = num("replicas", int, 1)
    cpus = num("replica_cpus", float, 1.0)
    auto = _autoscaling(num("min_replicas", int), num("max_replicas", int), num("target_ongoing_requests", float))
    options = {}
    for k, v in args.items():
        if k not in SERVE_DEFAULTS:
            raise SparrowError(f"unknown sparrow replica option {k!r} (known: {', '.join(SERVE_DEFAULTS)})")
        default = SERVE_DEFAULTS[k]
        options[k] = v in ("1", "true", "True") if isinstance(default, bool) else v
    for k in ("ctx", "yarn_orig_ctx", "max_batch", "max_queue", "max_images_per_request", "max_pixels_per_request"):
        if options.get(k) is not None:
            options[k] = int(options[k])
    for k in ("request_timeout", "body_timeout", "rope_scale"):
        if options.get(k) is not None:
            options[k] = float(options[k])
    return deployment(options, replicas, cpus, auto)


def serve_ray(args) -> None:
    """`sparrow serve --ray`: the application on a Ray cluster (a new local one unless
    --ray-address names one), HTTP on --host/--port, until Ctrl-C."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SparrowError("--ray needs Ray Serve: pip install 'sparrow[ray]'") from None
    options = {k: getattr(args, k, d) for k, d in SERVE_DEFAULTS.items()}
    rope_scaling_from_flags(
        options["rope_scaling"], options["rope_scale"], options["yarn_orig_ctx"]
    )  # before Ray starts
    auto = _autoscaling(args.min_replicas, args.max_replicas, args.target_ongoing_requests)
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"sparrow: Ray Serve on http://{args.host}:{args.port} (replicas loading)", file=sys.stderr, flush=True)
    try:
        serve.run(
            deployment(options, args.replicas, args.replica_cpus, auto), name="sparrow", route_prefix="/", blocking=True
        )
    finally:
        serve.shutdown()
