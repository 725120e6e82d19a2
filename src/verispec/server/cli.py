"""`verispec serve`: the OpenAI-compatible server, configured at the edge."""

from __future__ import annotations

import argparse
import ipaddress
import sys


from ..cli import _nonneg_int, _positive_int  # noqa: E402  (shared argument types)


def _port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {v}")
    return v


def add_serve_parser(sub) -> None:
    from ..verify import RULES

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming, metrics)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics. Per request, the body field "
                                   '"verispec": {"speculate": false} turns speculation off (a reference run '
                                   'on the same server) and {"rule": ...} picks the verification rule.')
    s.add_argument("--target", required=True, help="preset name, HF directory, GGUF file or hub id")
    s.add_argument("--draft", default=None,
                   help="none | lookup[:N] | layerskip:N | a draft model (preset, path, hub id)")
    s.add_argument("--k", type=_nonneg_int, default=None,
                   help="draft tokens per step (the most, with the adaptive policy); "
                        "default 8 with --policy adaptive, 4 with fixed")
    s.add_argument("--policy", default="adaptive", choices=["adaptive", "fixed"],
                   help="adaptive: per row and step, from costs timed at start-up and running "
                        "acceptance (never slower); fixed: always k")
    s.add_argument("--verify", default="rejection", choices=list(RULES),
                   help="verification rule for sampled requests; typical-lossy is LOSSY")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    s.add_argument("--max-batch", type=_positive_int, default=8, help="rows decoded together")
    s.add_argument("--max-len", type=_positive_int, default=2048,
                   help="context per row: prompt + max_tokens (capped at the model's)")
    s.add_argument("--max-queue", type=_nonneg_int, default=64,
                   help="requests waiting for a row; beyond it requests get 429")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --target)")
    s.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(func=cmd_serve)


def build_state(args):
    """Load the model, build the engine and the server state from parsed arguments."""
    from ..drafters import make_drafter
    from ..engine import Engine, EngineConfig
    from ..models import load_model
    from ..policy import make_policy, resolve_k
    from .app import ServerConfig, ServerState
    from .worker import PerRequestPolicy

    args.k = resolve_k(args.policy, args.k)

    loaded = load_model(args.target)
    target, tok = loaded.model, loaded.tokenizer
    max_len = min(args.max_len, target.config.max_position_embeddings)
    drafter = make_drafter(args.draft, target, tok, max_rows=args.max_batch, max_len=max_len + args.k + 2)
    policy = PerRequestPolicy(make_policy(args.policy, target, drafter, args.max_batch, args.k))
    engine = Engine(target, drafter, policy, EngineConfig(max_batch=args.max_batch, max_len=max_len,
                                                          rule=args.verify))
    config = ServerConfig(model_name=args.served_model_name or args.target, api_key=args.api_key,
                          max_queue=args.max_queue, drafter=args.draft if drafter is not None else None)
    return ServerState(engine, tok, config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    import torch
    import uvicorn

    from .app import create_app

    if args.verify == "typical-lossy" and args.draft:
        print("WARNING: --verify typical-lossy is LOSSY: sampled output is NOT distributed as the target's; "
              "responses carry \"lossy\": true", file=sys.stderr)
    if not _is_loopback(args.host) and args.api_key is None:
        print(f"WARNING: binding to {args.host} (not loopback) without --api-key: anyone who can reach "
              "this address can use the server", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    state = build_state(args)
    app = create_app(state)
    print(f"verispec serve: {state.config.model_name} (draft {args.draft or 'none'}, k={state.k}, "
          f"policy {state.policy}, rule {args.verify}) on http://{args.host}:{args.port}", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
