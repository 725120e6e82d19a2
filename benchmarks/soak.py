"""A bounded soak test of `verispec serve` on loopback: N clients for D minutes.

    # the full run (20 minutes, 16 clients, SmolLM2-135M with prompt lookup)
    python benchmarks/soak.py --target smollm2-135m --draft lookup --clients 16 --minutes 20
    # a quick run on the tiny random test model (no weights needed)
    python benchmarks/soak.py --tiny --minutes 1
    # against a server that is already running (its PID for RSS / fd sampling)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 12345 --minutes 5

The script starts the server itself (unless --url), on 127.0.0.1 only, and stops it with
SIGTERM at the end (it must drain and exit with status 0). Each client loops until the
deadline (and at most --max-requests-per-client requests), choosing per request:

* ~5% hostile or malformed (bad JSON, invalid UTF-8, deep nesting, a wrong content
  type, an oversize body, huge or overlong stop lists, out-of-range sampling
  parameters, an unknown model or route): each must get a 4xx;
* ~10% that disconnect mid-stream or mid-request (the row must be freed);
* the rest well-formed, streamed or not, chat or completion: greedy ones and seeded
  sampled ones (keyed noise) are checked against reference answers computed once at
  the start from the same server with "verispec": {"speculate": false}; unseeded
  sampled ones must complete. A 429 (queue full) is retried after a pause.

It samples the server process's RSS (psutil if installed, else /proc/PID/status), open
file descriptors (/proc/PID/fd), threads, and the /metrics gauges (rows in use, running,
waiting) at the start, every --sample-every seconds and at the end; prints a table and
a JSON summary (also to --json PATH), and exits 1 if anything leaked (rows, fds,
threads, RSS growth after the first quarter beyond --rss-growth-mb), a garbage-collector
pause exceeded --max-gc-pause-ms (when given), any greedy or seeded answer mismatched,
any request got an unexpected answer, or the server did not drain and exit cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from verispec.audit.suite import load_suite  # noqa: E402

MAX_BODY = 4 * 2 ** 20  # the server's default body limit
MAX_PROMPT_CHARS = 500  # suite prompts up to this long: they fit --max-len 1024 with 400 new tokens, any tokenizer


class SoakError(Exception):
    """The soak could not run (not a verdict on the server)."""


# -- the server process -------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("VERISPEC_API_KEY", None)  # the server this script starts has no key
    if args.tiny:
        cmd = [sys.executable, "-m", "tests.server.tiny_server", "--max-batch", str(args.max_batch),
               "--max-queue", str(args.max_queue), "--max-len", str(args.max_len), "--k", "3",
               "--drain-timeout", str(args.drain_timeout), "--max-seconds", str(args.minutes * 60 + 900)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            proc.kill()
            raise SystemExit(f"soak: the tiny server did not start ({line!r})")
        return proc, f"http://127.0.0.1:{int(line.split()[1])}"
    port = _free_port()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--target", args.target, "--host", "127.0.0.1",
           "--port", str(port), "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
           "--max-len", str(args.max_len), "--drain-timeout", str(args.drain_timeout), "--log-level", "warning"]
    if args.draft and args.draft != "none":
        cmd += ["--draft", args.draft]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"soak: verispec serve exited with status {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"soak: verispec serve did not answer /health within {args.startup_timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float) -> dict:
    """SIGTERM, then the exit status and how long the drain took (killed if it hangs)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout)
        hung = False
    except subprocess.TimeoutExpired:
        proc.kill()
        rc, hung = proc.wait(), True
    if proc.stdin:
        proc.stdin.close()
    return {"exit_status": rc, "seconds": round(time.monotonic() - t0, 2), "hung": hung}


# -- sampling the server -------------------------------------------------------------

def proc_stats(pid: int) -> dict:
    out = {"rss_mb": None, "fds": None, "threads": None}
    try:
        import psutil
        p = psutil.Process(pid)
        out["rss_mb"] = p.memory_info().rss / 2 ** 20
        out["threads"] = p.num_threads()
        out["fds"] = p.num_fds()
        return out
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - the process is gone: report what is known
        return out
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mb"] = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def gauges(text: str) -> dict:
    want = {"verispec_cache_rows_in_use": "rows_in_use", "verispec_num_requests_running": "running",
            "verispec_num_requests_waiting": "waiting", "verispec_suffix_cache_nodes": "suffix_nodes",
            "verispec_suffix_cache_max_nodes": "suffix_max_nodes", "verispec_suffix_cache_sequences": "suffix_sequences",
            "verispec_suffix_cache_evictions_total": "suffix_evictions"}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        key, _, value = line.rpartition(" ")
        name = key.partition("{")[0]
        if name in want:
            out[want[name]] = out.get(want[name], 0) + int(float(value))
        if name == "verispec_gc_pause_max_seconds":
            out["gc_max_pause_s"] = float(value)
        if name == "verispec_gc_pause_seconds_count" and 'generation="2"' in key:
            out["gc_full"] = int(float(value))
        if name == "verispec_request_finish_total":
            reason = key.partition('reason="')[2].partition('"')[0]
            out[f"finish_{reason}"] = out.get(f"finish_{reason}", 0) + int(float(value))
    return out


async def sample(c: httpx.AsyncClient, pid: int | None, t0: float) -> dict:
    s = {"t": round(time.monotonic() - t0, 1)}
    if pid is not None:
        s.update(proc_stats(pid))
    try:
        s.update(gauges((await c.get("/metrics", timeout=30)).text))
        s["health"] = (await c.get("/health", timeout=30)).status_code
    except httpx.HTTPError as e:
        s["health"] = f"error: {type(e).__name__}"
    return s


# -- the requests --------------------------------------------------------------------

@dataclass
class Job:
    chat: bool
    prompt: str
    max_tokens: int
    sampling: dict  # temperature, top_p, seed ...
    checked: bool  # has a reference answer


def _body(model: str, job: Job, stream: bool, **extra) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": job.max_tokens, "stream": stream, **job.sampling, **extra}
    if job.chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": job.prompt}]}
    return "/v1/completions", {**body, "prompt": job.prompt}


async def complete(c: httpx.AsyncClient, path: str, body: dict, chat: bool) -> tuple[int, str | None, str | None, str]:
    """(status, text, finish_reason, error detail) for a streamed or plain request."""
    if not body.get("stream"):
        r = await c.post(path, json=body)
        if r.status_code != 200:
            return r.status_code, None, None, r.text[:300]
        ch = r.json()["choices"][0]
        return 200, ch["message"]["content"] if chat else ch["text"], ch["finish_reason"], ""
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, None, None, (await r.aread()).decode(errors="replace")[:300]
        text, finish, done = "", None, False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                return 500, None, None, json.dumps(obj["error"])[:300]
            if obj["choices"]:
                ch = obj["choices"][0]
                text += (ch["delta"].get("content") or "") if chat else ch["text"]
                finish = ch["finish_reason"] or finish
        if not done:
            return 599, None, None, "the stream ended without [DONE]"
        return 200, text, finish, ""


def hostile(model: str, rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(name, path, raw body, headers) of a request that must be refused with a 4xx."""
    J = {"Content-Type": "application/json"}
    ok = {"model": model, "prompt": "hello", "max_tokens": 4}
    bad_params = [{"temperature": 1e-3}, {"temperature": -1}, {"temperature": "hot"}, {"top_p": 0},
                  {"top_k": -5}, {"min_p": 1.5}, {"seed": 2 ** 70}, {"max_tokens": 0}, {"max_tokens": 10 ** 9},
                  {"n": 3}, {"logit_bias": {"1": 5}}, {"verispec": {"rule": "typical-lossy"}, "temperature": 1},
                  {"verispec": {"rule": "coupled"}, "temperature": 1}]
    kinds = [
        ("bad JSON", "/v1/completions", b'{"model": "x", "prompt": ', J),
        ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', J),
        ("deep nesting", "/v1/completions", b"[" * 50_000 + b"]" * 50_000, J),
        ("wrong content type", "/v1/completions", json.dumps(ok).encode(), {"Content-Type": "text/plain"}),
        ("oversize body", "/v1/completions", json.dumps({**ok, "prompt": "a" * (MAX_BODY + 4096)}).encode(), J),
        ("huge stop list", "/v1/completions", json.dumps({**ok, "stop": [f"s{i}" for i in range(2000)]}).encode(), J),
        ("overlong stop", "/v1/completions", json.dumps({**ok, "stop": ["x" * 20_000]}).encode(), J),
        ("bad params", "/v1/completions", json.dumps({**ok, **rng.choice(bad_params)}).encode(), J),
        ("bad chat params", "/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": "wizard", "content": "x"}]}).encode(), J),
        ("unknown model", "/v1/completions", json.dumps({**ok, "model": "gpt-nope"}).encode(), J),
        ("unknown route", "/v1/embeddings", json.dumps(ok).encode(), J),
        ("NaN literal", "/v1/completions", b'{"model": "x", "prompt": "x", "temperature": NaN}', J),
    ]
    return rng.choice(kinds)


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    checked: int = 0
    mismatches: list = field(default_factory=list)
    disconnects: int = 0
    hostile_sent: int = 0
    hostile_refused: int = 0
    refused_429: int = 0
    unexpected: list = field(default_factory=list)
    by_kind: dict = field(default_factory=dict)


async def one(c: httpx.AsyncClient, model: str, rng: random.Random, jobs: list[Job], refs: dict,
              long_prompt: str, tally: Tally, deadline: float) -> None:
    tally.requests += 1
    roll = rng.random()
    if roll < 0.05:  # hostile
        name, path, raw, headers = hostile(model, rng)
        tally.hostile_sent += 1
        tally.by_kind[name] = tally.by_kind.get(name, 0) + 1
        r = await c.post(path, content=raw, headers=headers)
        if 400 <= r.status_code < 500 and "error" in r.json():
            tally.hostile_refused += 1
        else:
            tally.unexpected.append({"hostile": name, "status": r.status_code, "body": r.text[:200]})
        return
    if roll < 0.15:  # disconnect mid-stream or mid-request
        job = Job(rng.random() < 0.5, long_prompt, 400, {"temperature": 0, "ignore_eos": True}, False)
        path, body = _body(model, job, stream=rng.random() < 0.6)
        tally.disconnects += 1
        if body["stream"]:
            async with c.stream("POST", path, json=body) as r:
                if r.status_code == 429:
                    tally.refused_429 += 1
                    return
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= rng.randint(1, 4):
                        return  # leaving the block closes the connection mid-stream
        else:
            try:
                await c.post(path, json=body, timeout=httpx.Timeout(60, read=rng.uniform(0.2, 1.0)))
            except httpx.TimeoutException:
                pass  # gone mid-request
        return
    job = rng.choice(jobs)
    stream = rng.random() < 0.5
    path, body = _body(model, job, stream)
    for attempt in range(50):
        if time.monotonic() > deadline + 120:
            return
        status, text, finish, detail = await complete(c, path, body, job.chat)
        if status != 429:
            break
        tally.refused_429 += 1
        await asyncio.sleep(0.05 * (1 + attempt % 8))
    if status != 200:
        tally.unexpected.append({"job": job.prompt[:40], "status": status, "detail": detail})
        return
    if finish not in ("stop", "length"):
        tally.unexpected.append({"job": job.prompt[:40], "finish_reason": finish})
        return
    tally.ok += 1
    if job.checked:
        tally.checked += 1
        want = refs[id(job)]
        if (text, finish) != want:
            i = next((k for k, (a, b) in enumerate(zip(text, want[0])) if a != b), min(len(text), len(want[0])))
            tally.mismatches.append({"prompt": job.prompt[:60], "chat": job.chat, "stream": stream,
                                     "sampling": job.sampling, "first_divergence_char": i,
                                     "got": text[max(0, i - 20):i + 40], "want": want[0][max(0, i - 20):i + 40],
                                     "finish": (finish, want[1])})


def make_jobs(n_prompts: int, rng: random.Random) -> tuple[list[Job], str]:
    suite = [p for p in load_suite("default") if len(p.prompt) <= MAX_PROMPT_CHARS]
    rng.shuffle(suite)
    prompts = [p.prompt for p in suite[:n_prompts]]
    jobs = []
    for i, prompt in enumerate(prompts):
        chat = i % 2 == 0
        mt = rng.choice([16, 24, 32, 48])
        jobs.append(Job(chat, prompt, mt, {"temperature": 0}, True))  # greedy: checked
        jobs.append(Job(chat, prompt, mt, {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}, True))  # keyed
        jobs.append(Job(not chat, prompt, mt, {"temperature": 1.0, "top_p": 0.9}, False))  # unseeded
    return jobs, suite[-1].prompt


async def references(url: str, headers: dict, model: str, jobs: list[Job], concurrency: int) -> dict:
    """Each checked job once, non-streamed, with speculation off: plain decoding."""
    refs: dict = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as c:
        async def ref(job):
            async with sem:
                path, body = _body(model, job, stream=False, verispec={"speculate": False})
                for attempt in range(200):
                    status, text, finish, detail = await complete(c, path, body, job.chat)
                    if status != 429:
                        break
                    await asyncio.sleep(0.2)
                if status != 200:
                    raise SoakError(f"a reference request failed ({status}): {detail}")
                refs[id(job)] = (text, finish)
        await asyncio.gather(*(ref(j) for j in jobs if j.checked))
    return refs


async def soak(args, url: str, pid: int | None) -> dict:
    headers = {}
    key = args.api_key or os.environ.get("VERISPEC_API_KEY") if args.url else None
    if key:
        headers["Authorization"] = f"Bearer {key}"
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
    jobs, long_prompt = make_jobs(args.prompts, rng)
    t_ref = time.monotonic()
    refs = await references(url, headers, model, jobs, concurrency=min(args.clients, 8))
    print(f"soak: {len(refs)} reference answers (speculation off) in {time.monotonic() - t_ref:.0f} s",
          file=sys.stderr)
    await asyncio.sleep(1.0)  # reference connections closed: a quiet baseline
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    tallies = [Tally() for _ in range(args.clients)]
    samples = []
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(180), limits=limits) as mon:
        samples.append(await sample(mon, pid, t0))
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(180),
                                     limits=limits) as c:
            async def client(i: int):
                crng = random.Random(args.seed * 1000 + i)
                for _ in range(args.max_requests_per_client):
                    if time.monotonic() >= deadline:
                        return
                    try:
                        await one(c, model, crng, jobs, refs, long_prompt, tallies[i], deadline)
                    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                        tallies[i].unexpected.append({"exception": f"{type(e).__name__}: {e}"[:300]})

            async def sampler():
                while time.monotonic() < deadline:
                    await asyncio.sleep(min(args.sample_every, max(0.0, deadline - time.monotonic())))
                    samples.append(await sample(mon, pid, t0))

            work = asyncio.gather(*(client(i) for i in range(args.clients)))
            await asyncio.wait_for(asyncio.gather(work, sampler()), args.minutes * 60 + 600)
        duration = time.monotonic() - t0
        # idle again: every row and queue place released
        idle_deadline = time.monotonic() + 60
        while True:
            await asyncio.sleep(1.0)
            last = await sample(mon, pid, t0)
            if (last.get("rows_in_use", 1) == 0 and last.get("running", 1) == 0 and last.get("waiting", 1) == 0) \
                    or time.monotonic() > idle_deadline:
                break
        samples.append(last)
    await asyncio.sleep(1.0)  # the monitor's connection closed too
    if pid is not None:
        final = proc_stats(pid)
        samples[-1].update({k: v for k, v in final.items() if v is not None})

    total = Tally()
    for t in tallies:
        for k in ("requests", "ok", "checked", "disconnects", "hostile_sent", "hostile_refused", "refused_429"):
            setattr(total, k, getattr(total, k) + getattr(t, k))
        total.mismatches += t.mismatches
        total.unexpected += t.unexpected
        for k, v in t.by_kind.items():
            total.by_kind[k] = total.by_kind.get(k, 0) + v
    return {"duration_s": round(duration, 1), "clients": args.clients, "model": model, "url": url,
            "tally": total, "samples": samples}


# -- the verdict -----------------------------------------------------------------------

def verdict(res: dict, args, shutdown: dict | None) -> tuple[dict, list[str]]:
    t: Tally = res["tally"]
    s = res["samples"]
    first, last = s[0], s[-1]
    quarter = next((x for x in s if x["t"] >= res["duration_s"] / 4), first)
    problems = []
    for g in ("rows_in_use", "running", "waiting"):
        if last.get(g) != 0:
            problems.append(f"{g} is {last.get(g)} after the soak (leaked rows or queue places)")
    if last.get("health") != 200:
        problems.append(f"/health answered {last.get('health')} at the end")
    if first.get("fds") is not None and last.get("fds") is not None and last["fds"] > first["fds"] + args.fd_slack:
        problems.append(f"open file descriptors grew {first['fds']} -> {last['fds']}")
    if first.get("threads") is not None and last.get("threads") is not None \
            and last["threads"] > first["threads"] + 2:
        problems.append(f"threads grew {first['threads']} -> {last['threads']}")
    if quarter.get("rss_mb") is not None and last.get("rss_mb") is not None \
            and last["rss_mb"] - quarter["rss_mb"] > args.rss_growth_mb:
        problems.append(f"RSS grew {quarter['rss_mb']:.0f} -> {last['rss_mb']:.0f} MiB after the first quarter "
                        f"(bound {args.rss_growth_mb} MiB)")
    over = [x for x in s if x.get("suffix_nodes") is not None and x["suffix_nodes"] > x["suffix_max_nodes"]]
    if over:
        problems.append(f"the suffix cache held {max(x['suffix_nodes'] for x in over)} trie nodes, over its bound "
                        f"of {over[0]['suffix_max_nodes']}, in {len(over)} samples")
    gc_max = max((x.get("gc_max_pause_s") or 0.0) for x in s)
    if args.max_gc_pause_ms is not None and gc_max * 1e3 > args.max_gc_pause_ms:
        problems.append(f"a garbage-collector pause took {gc_max * 1e3:.0f} ms (bound {args.max_gc_pause_ms} ms)")
    if t.mismatches:
        problems.append(f"{len(t.mismatches)} checked answers differ from their reference")
    if t.unexpected:
        problems.append(f"{len(t.unexpected)} unexpected answers")
    if t.checked == 0:
        problems.append("no checked answer completed: the soak proves nothing")
    if shutdown is not None and (shutdown["exit_status"] != 0 or shutdown["hung"]):
        problems.append(f"the server did not drain and exit cleanly on SIGTERM ({shutdown})")
    summary = {
        "pass": not problems, "problems": problems, "duration_s": res["duration_s"], "clients": res["clients"],
        "model": res["model"], "requests": t.requests, "completed": t.ok, "checked_against_reference": t.checked,
        "mismatches": len(t.mismatches), "disconnects": t.disconnects, "bad_requests_sent": t.hostile_sent,
        "bad_requests_refused_4xx": t.hostile_refused, "bad_request_kinds": t.by_kind, "retried_429": t.refused_429,
        "unexpected": len(t.unexpected),
        "rss_mb": {"start": first.get("rss_mb"), "quarter": quarter.get("rss_mb"), "end": last.get("rss_mb")},
        "fds": {"start": first.get("fds"), "end": last.get("fds")},
        "threads": {"start": first.get("threads"), "end": last.get("threads")},
        "rows_in_use": {"start": first.get("rows_in_use"), "max": max((x.get("rows_in_use") or 0) for x in s),
                        "end": last.get("rows_in_use")},
        "suffix_cache": None if last.get("suffix_max_nodes") is None else {
            "max_nodes": last["suffix_max_nodes"], "peak_nodes": max(x.get("suffix_nodes") or 0 for x in s),
            "end_nodes": last.get("suffix_nodes"), "end_sequences": last.get("suffix_sequences"),
            "evictions": last.get("suffix_evictions")},
        "gc": {"max_pause_ms": gc_max * 1e3, "full_collections": last.get("gc_full")},
        "cancelled_in_engine": (last.get("finish_cancelled") or 0) - (first.get("finish_cancelled") or 0),
        "shutdown": shutdown, "mismatch_examples": t.mismatches[:5], "unexpected_examples": t.unexpected[:5],
        "samples": s,
    }
    return summary, problems


def _mb(x) -> str:
    return "-" if x is None else f"{x:.0f} MiB"


def print_table(sm: dict) -> None:
    rows = [
        ("duration", f"{sm['duration_s']:.0f} s, {sm['clients']} clients, model {sm['model']}"),
        ("requests", f"{sm['requests']} ({sm['completed']} completed, {sm['retried_429']} retries after 429)"),
        ("checked vs reference", f"{sm['checked_against_reference']} (mismatches: {sm['mismatches']})"),
        ("disconnects", f"{sm['disconnects']} (engine cancelled {sm['cancelled_in_engine']} rows)"),
        ("bad requests", f"{sm['bad_requests_sent']} sent, {sm['bad_requests_refused_4xx']} refused with 4xx"),
        ("unexpected answers", str(sm["unexpected"])),
        ("RSS start/quarter/end", " / ".join(_mb(sm["rss_mb"][k]) for k in ("start", "quarter", "end"))),
        ("rows in use start/max/end", " / ".join(str(sm["rows_in_use"][k]) for k in ("start", "max", "end"))),
        ("suffix cache nodes peak/bound", "-" if sm["suffix_cache"] is None else
         f"{sm['suffix_cache']['peak_nodes']} / {sm['suffix_cache']['max_nodes']} "
         f"({sm['suffix_cache']['evictions']} evictions, {sm['suffix_cache']['end_sequences']} sequences held)"),
        ("garbage collector", f"longest pause {sm['gc']['max_pause_ms']:.1f} ms, "
         f"{sm['gc']['full_collections']} full collections"),
        ("open fds start/end", f"{sm['fds']['start']} / {sm['fds']['end']}"),
        ("threads start/end", f"{sm['threads']['start']} / {sm['threads']['end']}"),
        ("SIGTERM", "-" if sm["shutdown"] is None else
         f"exit {sm['shutdown']['exit_status']} after {sm['shutdown']['seconds']} s"),
        ("verdict", "PASS" if sm["pass"] else "FAIL: " + "; ".join(sm["problems"])),
    ]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="lookup")
    ap.add_argument("--tiny", action="store_true", help="serve the tiny random test model (tests/server)")
    ap.add_argument("--url", default=None, help="soak a running server instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's PID (RSS, fds, threads)")
    ap.add_argument("--api-key", default=None, help="with --url: its API key (default $VERISPEC_API_KEY)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--max-requests-per-client", type=int, default=100_000)
    ap.add_argument("--prompts", type=int, default=12, help="suite prompts (x3 jobs: greedy, seeded, unseeded)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="server torch threads")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--rss-growth-mb", type=float, default=64.0, help="allowed RSS growth after the first quarter")
    ap.add_argument("--max-gc-pause-ms", type=float, default=None,
                    help="fail if the server's longest garbage-collector pause (its /metrics) exceeds this")
    ap.add_argument("--fd-slack", type=int, default=8, help="allowed growth of open file descriptors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the JSON summary here")
    args = ap.parse_args()
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        raise SystemExit("soak: --url must be a loopback address")

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    shutdown = None
    try:
        res = asyncio.run(soak(args, url, pid))
    except SoakError as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            shutdown = stop_server(proc, args.drain_timeout + 30)
    summary, problems = verdict(res, args, shutdown)
    print_table(summary)
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
