"""A bounded load test on loopback: >= 200 requests from 32 concurrent clients against the
tiny server in its own process (8 rows, 16 queued: capacity 24 < 32 clients, so some
requests are refused with 429 and retried), 10% of them disconnecting mid-stream.

Shows: no error answers but the intended 429s; every completed greedy answer equal to
offline plain decoding (Engine without drafter) of the same prompt; no rows held
afterwards; the server's RSS flat.
"""

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import MODEL, CharTokenizer, metric, plain_reference

ROOT = Path(__file__).resolve().parents[2]
N_REQUESTS, CLIENTS, DISCONNECT_EVERY = 220, 32, 10  # every 10th request disconnects mid-stream
DEADLINE_S = 110
RSS_BOUND_MB = 24


def _jobs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(rng.randint(3, 40)))
        job = {"i": i, "prompt": prompt, "chat": i % 4 in (2, 3), "stream": i % 2 == 1,
               "max_tokens": rng.randint(4, 24), "speculate": i % 10 != 5, "disconnect": i % DISCONNECT_EVERY == 9}
        if job["disconnect"]:
            # 900 tokens take seconds: still running when the client, however starved, cuts off
            job.update(stream=True, max_tokens=900)
        jobs.append(job)
    return jobs


def _payload(job: dict) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": job["max_tokens"], "temperature": 0, "stream": job["stream"]}
    if job["disconnect"]:
        body["ignore_eos"] = True
    if not job["speculate"]:
        body["verispec"] = {"speculate": False}
    if job["chat"]:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": job["prompt"]}]}
    return "/v1/completions", {**body, "prompt": job["prompt"]}


async def _one(c: httpx.AsyncClient, job: dict) -> dict:
    """Send one job until it is not refused; returns status, text, finish reason, 429 count."""
    path, body = _payload(job)
    refused = 0
    for attempt in range(200):
        if not job["stream"]:
            r = await c.post(path, json=body)
            if r.status_code == 429:
                refused += 1
                await asyncio.sleep(0.02 * (1 + attempt % 5))
                continue
            if r.status_code != 200:
                return {"status": r.status_code, "body": r.text, "refused": refused}
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if job["chat"] else choice["text"]
            return {"status": 200, "text": text, "finish": choice["finish_reason"], "refused": refused}
        async with c.stream("POST", path, json=body) as r:
            if r.status_code == 429:
                await r.aread()
                refused += 1
                await asyncio.sleep(0.02 * (1 + attempt % 5))
                continue
            if r.status_code != 200:
                return {"status": r.status_code, "body": (await r.aread()).decode(), "refused": refused}
            text, finish, events = "", None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if job["disconnect"] and events == 3:
                    return {"status": 200, "disconnected": True, "refused": refused}  # closes the stream
                if line == "data: [DONE]":
                    break
                ch = json.loads(line[6:])["choices"]
                if ch:
                    text += (ch[0]["delta"].get("content") or "") if job["chat"] else ch[0]["text"]
                    finish = ch[0]["finish_reason"] or finish
            return {"status": 200, "text": text, "finish": finish, "refused": refused}
    return {"status": "gave up", "refused": refused}


async def _run_all(url: str, jobs: list[dict], clients: int) -> list[dict]:
    results: dict[int, dict] = {}
    todo: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        todo.put_nowait(j)
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        async def client():
            while not todo.empty():
                job = todo.get_nowait()
                try:
                    results[job["i"]] = await _one(c, job)
                except Exception as e:  # noqa: BLE001 - recorded and asserted on below
                    results[job["i"]] = {"status": f"exception {type(e).__name__}: {e}", "refused": 0}
        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), DEADLINE_S)
    return [results[j["i"]] for j in jobs]


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "tests.server.tiny_server", "--max-batch", "8",
                             "--max-queue", "16", "--k", "3", "--max-len", "1024", "--max-seconds", "240"],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"server did not start: {line!r}"
        yield proc, f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.stdin.close()  # the server stops itself when its input closes
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _rss(pid: int) -> int:
    """Resident set size in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _idle(url: str, timeout: float = 15.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        busy = sum(metric(text, n) for n in ("verispec_cache_rows_in_use", "verispec_num_requests_running",
                                             "verispec_num_requests_waiting"))
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_load(server):
    proc, url = server
    # warm-up: allocator pools, tokenizer pool thread, uvicorn connection objects
    warm = asyncio.run(_run_all(url, _jobs(48, seed=1), clients=CLIENTS))
    assert all(r["status"] == 200 for r in warm)
    base = _idle(url)  # counters are cumulative: compare differences
    rss_before = _rss(proc.pid)

    jobs = _jobs(N_REQUESTS)
    t0 = time.monotonic()
    results = asyncio.run(_run_all(url, jobs, clients=CLIENTS))
    duration = time.monotonic() - t0
    metrics = _idle(url)
    rss_after = _rss(proc.pid)

    errors = [(j["i"], r) for j, r in zip(jobs, results) if r["status"] != 200]
    assert not errors, errors[:5]  # only 429s (retried) besides 200s

    done = [(j, r) for j, r in zip(jobs, results) if not r.get("disconnected")]
    tok = CharTokenizer()
    ids = [tok.apply_chat_template([{"role": "user", "content": j["prompt"]}]) if j["chat"] else tok.encode(j["prompt"])
           for j, _ in done]
    refs = plain_reference(ids, [j["max_tokens"] for j, _ in done])
    mismatches = [(j["i"], r["text"], tok.decode(out, skip_special_tokens=True))
                  for (j, r), (out, reason) in zip(done, refs)
                  if (r["text"], r["finish"]) != (tok.decode(out, skip_special_tokens=True), reason)]
    assert not mismatches, mismatches[:5]

    disconnects = sum(1 for r in results if r.get("disconnected"))
    refused = sum(r["refused"] for r in results)
    assert disconnects == N_REQUESTS // DISCONNECT_EVERY
    assert refused > 0  # the bounded queue did refuse: 32 clients > 24 places
    assert metric(metrics, "verispec_cache_rows_in_use") == 0
    assert metric(metrics, "verispec_num_requests_running") == 0
    assert metric(metrics, "verispec_num_requests_waiting") == 0
    def delta(name, **labels):
        return metric(metrics, name, **labels) - metric(base, name, **labels)
    assert delta("verispec_request_finish_total", reason="cancelled") == disconnects
    assert delta("verispec_requests_total", status="429") == refused
    assert sum(delta("verispec_requests_total", endpoint=e, status="200")
               for e in ("/v1/completions", "/v1/chat/completions")) == N_REQUESTS
    assert metric(metrics, "verispec_spec_decode_num_accepted_tokens_total") > 0
    growth_mb = (rss_after - rss_before) / 2 ** 20
    print(f"\nload test: {N_REQUESTS} requests ({len(done)} completed and equal to the plain reference, "
          f"{disconnects} disconnected mid-stream), {CLIENTS} concurrent clients, {refused} answers 429 "
          f"(retried), {duration:.1f} s, server RSS {rss_before / 2 ** 20:.1f} -> {rss_after / 2 ** 20:.1f} MiB "
          f"({growth_mb:+.1f} MiB), acceptance "
          f"{metric(metrics, 'verispec_spec_decode_acceptance_rate'):.2f}")
    assert duration < DEADLINE_S
    assert growth_mb < RSS_BOUND_MB
