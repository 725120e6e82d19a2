"""Which server software answers at a URL, its version and its settings, as the server
itself reports them (nothing assumed).

Each kind has an endpoint of its own, probed in turn:

* verispec: ``/v1/models`` with a ``verispec`` object (drafter, k, policy, rule, lossy);
* llama.cpp: ``/props`` (``build_info``, ``total_slots``, ``default_generation_settings``
  with the sampler defaults, ``model_path``) and ``/slots`` (per slot ``speculative``:
  whether the slot drafts; /props' ``speculative.types`` shows a request's default
  parameters, "none" even on a speculative server, so it is recorded but not trusted);
* vLLM: ``/version`` (``{"version": ...}``);
* SGLang: ``/get_server_info`` (the server arguments, ``speculative_*`` among them, and
  ``version``);
* TGI: ``/info`` (``model_id``, ``version``, ``sha``, ``router``).

Failing all of them, the /metrics prefixes name the kind (counters.server_kind).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import httpx

from .counters import MetricsParseError, server_kind, spec_counters

# settings worth recording per kind (keys of the kind's own document; dotted = nested)
LLAMA_CPP_SAMPLER = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "seed",
                     "n_probs", "samplers")


@dataclass
class ServerInfo:
    kind: str  # "verispec" | "llama.cpp" | "vllm" | "sglang" | "tgi" | "unknown"
    version: str | None = None
    settings: dict = field(default_factory=dict)  # what the server says about itself
    speculative: dict = field(default_factory=dict)  # its speculative settings, as it names them
    sampler_defaults: dict = field(default_factory=dict)  # applied unless a request says otherwise
    source: str | None = None  # the endpoint that identified it
    metrics: bool = False  # /metrics answered with Prometheus text
    metrics_has_spec_counters: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _get(http: httpx.Client, path: str):
    try:
        r = http.get(path)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def from_verispec(models: dict) -> ServerInfo | None:
    try:
        v = models["data"][0].get("verispec")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    if not isinstance(v, dict):
        return None
    spec = {k: v.get(k) for k in ("drafter", "k", "policy", "rule", "lossy") if k in v}
    return ServerInfo("verispec", version=v.get("version"), settings={"model": models["data"][0].get("id")},
                      speculative=spec, source="/v1/models")


def from_llama_cpp(props: dict) -> ServerInfo | None:
    if not isinstance(props, dict) or "default_generation_settings" not in props:
        return None
    params = (props.get("default_generation_settings") or {}).get("params") or {}
    spec = {k: v for k, v in params.items() if k.startswith("speculative")}
    settings = {k: props.get(k) for k in ("total_slots", "model_alias", "model_path", "model_ftype") if k in props}
    settings["n_ctx"] = (props.get("default_generation_settings") or {}).get("n_ctx")
    return ServerInfo("llama.cpp", version=props.get("build_info"), settings=settings, speculative=spec,
                      sampler_defaults={k: params[k] for k in LLAMA_CPP_SAMPLER if k in params}, source="/props")


def from_vllm(version: dict) -> ServerInfo | None:
    if not isinstance(version, dict) or set(version) - {"version"} or "version" not in version:
        return None
    return ServerInfo("vllm", version=str(version["version"]), source="/version",
                      notes=["vLLM does not publish its speculative config over HTTP; "
                             "record it from the launch command (--speculative-config)"])


def from_sglang(info: dict) -> ServerInfo | None:
    if not isinstance(info, dict) or not ("model_path" in info and any(k.startswith("speculative") for k in info)):
        return None
    spec = {k: v for k, v in info.items() if k.startswith("speculative") and not isinstance(v, (dict, list))}
    settings = {k: info.get(k) for k in ("model_path", "tp_size", "dp_size", "max_running_requests",
                                         "schedule_policy", "dtype", "quantization") if k in info}
    return ServerInfo("sglang", version=info.get("version"), settings=settings, speculative=spec,
                      source="/get_server_info")


def from_tgi(info: dict) -> ServerInfo | None:
    if not isinstance(info, dict) or "model_id" not in info or not ({"router", "max_total_tokens"} & set(info)):
        return None
    settings = {k: info.get(k) for k in ("model_id", "model_sha", "model_dtype", "max_concurrent_requests",
                                         "max_best_of", "max_input_tokens", "max_total_tokens", "sha") if k in info}
    spec = {k: v for k, v in info.items() if "specul" in k}
    return ServerInfo("tgi", version=info.get("version"), settings=settings, speculative=spec, source="/info")


# vLLM's /version is the least specific answer ({"version": ...} alone): asked last
PROBES = (("/v1/models", from_verispec), ("/props", from_llama_cpp), ("/get_server_info", from_sglang),
          ("/info", from_tgi), ("/version", from_vllm))


def probe(base: str, api_key: str | None = None, timeout_s: float = 30.0) -> ServerInfo:
    """Ask the server at `base` (no /v1) who it is. Never raises on an unreachable or odd
    server: the answer is then kind "unknown" with a note saying why."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = None
    with httpx.Client(base_url=base, headers=headers, timeout=timeout_s) as http:
        for path, read in PROBES:
            doc = _get(http, path)
            if doc is not None:
                info = read(doc)
                if info is not None:
                    break
        if info is not None and info.kind == "llama.cpp":
            slots = _get(http, "/slots")
            if isinstance(slots, list) and slots and all(isinstance(x, dict) for x in slots):
                info.speculative["slots_speculative"] = sum(bool(x.get("speculative")) for x in slots)
                info.speculative["slots"] = len(slots)
            else:
                info.notes.append("/slots not available (llama-server --no-slots): whether it drafts is unknown")
        page = None
        try:
            r = http.get("/metrics")
            page = r.text if r.status_code == 200 else None
        except httpx.HTTPError:
            pass
    if info is None:
        info = ServerInfo(server_kind(page) if page else "unknown", source="/metrics" if page else None)
        if info.kind == "unknown":
            info.notes.append("no endpoint of a known server kind answered (/v1/models, /props, /version, "
                              "/get_server_info, /info) and /metrics names none")
    if page is not None:
        try:
            info.metrics_has_spec_counters = spec_counters(page) is not None
            info.metrics = True
        except MetricsParseError as e:
            info.notes.append(str(e))
    else:
        info.notes.append("/metrics not available (llama-server needs --metrics; vLLM and verispec serve it; "
                          "SGLang needs --enable-metrics)")
    return info
