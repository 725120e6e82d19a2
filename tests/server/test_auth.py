"""The API key: /metrics needs it too unless the server is started with --metrics-public;
the key comes from --api-key-file, --api-key or $VERISPEC_API_KEY (in that order), and an
unreadable or empty key file is a clear error before anything loads."""

import httpx
import pytest

from tests.server.helpers import LiveServer, make_state
from verispec.cli import UsageError, build_parser, main
from verispec.cli.serve import ENV_API_KEY, resolve_api_key, resolve_api_keys

KEY = "sk-auth-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("public", [False, True], ids=["metrics-private", "metrics-public"])
def test_metrics_and_the_api_key(public):
    with LiveServer(make_state(drafter=None, api_key=KEY, metrics_public=public)) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            r = c.get("/metrics")
            if public:
                assert r.status_code == 200 and "verispec_info" in r.text
            else:
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["www-authenticate"] == "Bearer"
                assert c.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
            assert c.get("/metrics", headers=AUTH).status_code == 200
            assert c.get("/v1/models").status_code == 401  # the API itself needs the key either way
            assert c.get("/v1/models", headers=AUTH).status_code == 200
            assert c.get("/health").json() == {"status": "ok"}  # liveness probes need no key


def test_metrics_open_without_a_key():
    with LiveServer(make_state(drafter=None)) as s:
        assert httpx.get(s.url + "/metrics").status_code == 200


def _args(*extra):
    return build_parser().parse_args(["serve", "--target", "unused", *extra])


def test_key_sources_and_precedence(tmp_path):
    f = tmp_path / "key"
    f.write_text("  sk-from-file  \nsecond line ignored\n")
    env = {ENV_API_KEY: "sk-from-env"}
    assert resolve_api_key(_args(), {}) == (None, None)
    assert resolve_api_key(_args(), env) == ("sk-from-env", f"${ENV_API_KEY}")
    assert resolve_api_key(_args("--api-key", "sk-argv"), env) == ("sk-argv", "--api-key")
    assert resolve_api_key(_args("--api-key-file", str(f)), env) == ("sk-from-file", "--api-key-file")
    assert _args().metrics_public is False and _args("--metrics-public").metrics_public is True
    # several keys, one tenant each, separated by commas (as llama-server takes them)
    f.write_text("sk-a, sk-b\n")
    assert resolve_api_keys(_args("--api-key-file", str(f)), {}) == (["sk-a", "sk-b"], "--api-key-file")
    assert resolve_api_keys(_args("--api-key", "sk-a,sk-b,sk-c"), {})[0] == ["sk-a", "sk-b", "sk-c"]
    assert resolve_api_keys(_args(), {ENV_API_KEY: "sk-a,sk-b"})[0] == ["sk-a", "sk-b"]
    for bad, match in (("sk-a,,sk-b", "empty"), ("sk-a,sk-a", "twice"), ("sk-a,", "empty")):
        with pytest.raises(UsageError, match=match):
            resolve_api_keys(_args("--api-key", bad), {})


@pytest.mark.parametrize("setup,match", [
    (lambda p: None, "cannot read --api-key-file"),  # missing
    (lambda p: p.write_text("\n\n"), "empty"),
    (lambda p: p.write_text("   \nsk-second-line\n"), "empty"),  # the key is the first line
    (lambda p: p.write_bytes(b"\xff\xfe\x00k"), "cannot read --api-key-file"),
    (lambda p: p.write_text("sk with space\n"), "without spaces"),
    (lambda p: p.mkdir(), "cannot read --api-key-file"),
], ids=["missing", "empty", "blank-first-line", "not-utf8", "space", "directory"])
def test_bad_key_files(tmp_path, setup, match):
    p = tmp_path / "key"
    setup(p)
    with pytest.raises(UsageError, match=match):
        resolve_api_key(_args("--api-key-file", str(p)), {})


def test_bad_key_sources():
    with pytest.raises(UsageError, match="not both"):
        resolve_api_key(_args("--api-key", "a", "--api-key-file", "/dev/null"), {})
    with pytest.raises(UsageError, match="empty"):
        resolve_api_key(_args(), {ENV_API_KEY: "  "})
    with pytest.raises(UsageError, match="empty"):
        resolve_api_key(_args("--api-key", ""), {})


def test_serve_stops_before_loading_on_a_bad_key_file(tmp_path, capsys):
    """exit status 2 and a one-line message; the (nonexistent) target is never loaded."""
    assert main(["serve", "--target", str(tmp_path / "no-model"), "--api-key-file", str(tmp_path / "nokey")]) == 2
    err = capsys.readouterr().err
    assert "cannot read --api-key-file" in err and "Traceback" not in err
