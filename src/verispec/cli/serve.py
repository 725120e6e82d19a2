"""`verispec serve`: the OpenAI-compatible server, configured at the edge."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import sys
from pathlib import Path

from .common import (THREADS_HELP, UsageError, _nonneg_int, _positive_int, _threads, add_backend_argument,
                     add_speculation_arguments, build_engine, set_threads)

ENV_API_KEY = "VERISPEC_API_KEY"


def _port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {v}")
    return v


def _seconds(s: str) -> float:
    v = float(s)
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {s}")
    return v


def _check_key(key: str, source: str) -> str:
    if not key:
        raise UsageError(f"the API key from {source} is empty")
    if any(c.isspace() or not c.isprintable() for c in key) or not key.isascii():
        raise UsageError(f"the API key from {source} must be printable ASCII without spaces "
                         f"(it is sent as 'Authorization: Bearer <key>')")
    return key


def _check_keys(text: str, source: str) -> list[str]:
    keys = [_check_key(k.strip(), source) for k in text.split(",")] if text else [_check_key(text, source)]
    if len(set(keys)) != len(keys):
        raise UsageError(f"{source} names the same API key twice")
    return keys


def resolve_api_keys(args, environ=os.environ) -> tuple[list[str], str | None]:
    """The API keys and where they came from: --api-key-file or --api-key (the two
    together are an error), else $VERISPEC_API_KEY; none of them: no key. Each takes one
    key or several separated by commas (as llama-server's --api-key); the file's first line
    holds them (surrounding whitespace stripped). Each key is a tenant: a drafter that learns across requests keeps their text apart. An
    empty key from any source is an error, never "no key"."""
    if args.api_key_file is not None and args.api_key is not None:
        raise UsageError("give either --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            with path.open(encoding="utf-8") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --api-key-file {path}: {e}") from None
        return _check_keys(first.strip(), f"--api-key-file {path} (its first line)"), "--api-key-file"
    if args.api_key is not None:
        return _check_keys(args.api_key, "--api-key"), "--api-key"
    if ENV_API_KEY in environ:
        return _check_keys(environ[ENV_API_KEY].strip(), f"${ENV_API_KEY}"), f"${ENV_API_KEY}"
    return [], None


def resolve_api_key(args, environ=os.environ) -> tuple[str | None, str | None]:
    """The first API key (None: no key) and where it came from: resolve_api_keys."""
    keys, source = resolve_api_keys(args, environ)
    return (keys[0] if keys else None), source


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, streaming, metrics)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics. Per request, the body field "
                                   '"verispec": {"speculate": false} turns speculation off (a reference run '
                                   'on the same server) and {"rule": ...} picks the verification rule, '
                                   'honoured or refused (400), never substituted. A seeded sampled request is '
                                   'sampled with noise keyed on (seed, position) and verified by rule '
                                   '"coupled": the same tokens with or without speculation. SIGTERM drains: '
                                   'new requests get 503, requests in flight get --drain-timeout seconds.')
    s.add_argument("--target", required=True, help="preset name, HF directory, GGUF file or hub id")
    add_speculation_arguments(s, policy_help="adaptive: per row and step, from costs timed at start-up and "
                                             "running acceptance (never slower); fixed: always k",
                              verify_help="verification rule for sampled requests; typical-lossy is LOSSY")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics; several keys "
                        "separated by commas are tenants whose text --draft suffix never mixes. A command line is "
                        "visible to every user of the machine (ps, /proc): prefer --api-key-file or "
                        f"${ENV_API_KEY}. --api-key or --api-key-file (not both) override ${ENV_API_KEY}")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key (or keys, separated by commas) from the first line of PATH "
                        "(whitespace stripped)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (default: /metrics needs it when a key is set)")
    s.add_argument("--drain-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM: new requests get 503, requests in flight get this long to finish, "
                        "then fail with 503 'server shutting down' (default 30)")
    s.add_argument("--max-batch", type=_positive_int, default=8, help="rows decoded together")
    s.add_argument("--max-len", type=_positive_int, default=2048,
                   help="context per row: prompt + max_tokens (capped at the model's)")
    s.add_argument("--max-queue", type=_nonneg_int, default=64,
                   help="requests waiting for a row; beyond it requests get 429")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: --target)")
    s.add_argument("--threads", type=_threads, default="auto", help=THREADS_HELP)
    add_backend_argument(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    from ..audit.faults import argument as fault_argument
    # test only: a server with one of the project's faults, for the endpoint audit to catch from outside
    s.add_argument("--inject-fault", type=fault_argument, default=None, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_serve)


def build_state(args, api_key: str | list[str] | None = None, fault=None):
    """Load the model, build the engine and the server state from parsed arguments
    (api_key: a key or the keys from resolve_api_keys, each a tenant; fault: test only, an
    audit.faults.Fault the engine runs with)."""
    from ..models import load_model
    from ..policy import resolve_k
    from ..server.app import ServerConfig, ServerState
    from ..server.worker import PerRequestPolicy

    args.k = resolve_k(args.policy, args.k)

    set_threads(args.threads)  # a count: before loading; auto: timed on the loaded model
    loaded = load_model(args.target, backend=args.backend)
    target, tok = loaded.model, loaded.tokenizer
    set_threads(args.threads, target)  # before the adaptive policy times its costs
    max_len = min(args.max_len, target.config.max_position_embeddings)
    # the cost model is measured once per machine and configuration, then read from the cache;
    # the policy is wrapped before the engine is built: rows whose request says
    # "speculate": false draft k = 0
    engine = build_engine(target, tok, args, max_batch=args.max_batch, max_len=max_len, wrap=PerRequestPolicy,
                          fault=fault)
    drafter = engine.drafter
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    config = ServerConfig(model_name=args.served_model_name or args.target, api_key=keys[0] if keys else None,
                          more_api_keys=tuple(keys[1:]),
                          metrics_public=args.metrics_public, max_queue=args.max_queue,
                          drafter=args.draft if drafter is not None else None,
                          drain_timeout_s=args.drain_timeout)
    return ServerState(engine, tok, config)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args) -> int:
    api_key, key_source = resolve_api_keys(args)
    if args.verify == "typical-lossy" and args.draft:
        print("WARNING: --verify typical-lossy is LOSSY: sampled output is NOT distributed as the target's; "
              "responses carry \"lossy\": true", file=sys.stderr)
    if not _is_loopback(args.host) and not api_key:
        print(f"WARNING: binding to {args.host} (not loopback) without an API key (--api-key-file, "
              f"${ENV_API_KEY}): anyone who can reach this address can use the server", file=sys.stderr)
    if key_source == "--api-key":
        print("note: --api-key is visible to other users in the process list; --api-key-file or "
              f"${ENV_API_KEY} keep it out of argv", file=sys.stderr)
    fault = args.inject_fault
    if fault:
        from ..audit.faults import build
        print(f"TEST ONLY: injecting fault {fault!r}", file=sys.stderr)
        return _serve(args, api_key, key_source, build(fault))  # in the server's engine alone
    return _serve(args, api_key, key_source)


def _serve(args, api_key, key_source, fault=None) -> int:
    from ..server.app import make_server
    from ..server.gcpause import freeze_startup_heap

    state = build_state(args, api_key, fault)
    server = make_server(state, host=args.host, port=args.port, log_level=args.log_level)
    frozen = freeze_startup_heap()  # what start-up built lives as long as the process
    n = len(state.config.api_keys)
    auth = (f"{n} API key{'s' * (n > 1)} from {key_source}" + (", /metrics public" if args.metrics_public else "")
            if key_source else "no API key")
    print(f"verispec serve: {state.config.model_name} (draft {args.draft or 'none'}, k={state.k}, "
          f"policy {state.policy}, rule {args.verify}; {auth}; {frozen} start-up objects frozen out of "
          f"garbage collection) on http://{args.host}:{args.port}",
          file=sys.stderr)
    server.run()
    return 0
