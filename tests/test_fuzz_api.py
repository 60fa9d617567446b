"""The HTTP API fuzzed from its own OpenAPI schema with schemathesis: valid and invalid bodies for
every operation. No answer may be a 5xx, none may hang (each call has a timeout), every 4xx is
OpenAI's error shape, and the server still answers afterwards.

Bounded and repeatable: a fixed number of examples per operation, generated deterministically
(hypothesis derandomize), against the in-process server of test_openapi on the tiny model.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from test_fuzz_files import tiny_gguf  # noqa: F401 - fixtures, shared
from test_openapi import CHAT, served  # noqa: F401

EXAMPLES = 25  # per operation and generation mode (valid, invalid), after schemathesis' boundary cases
CTX = 48  # the served model's context: a valid request generates at most ~40 tokens
CALL_TIMEOUT = 60  # seconds: a call still unanswered by then is a hang (the tiny model answers in < 1 s)
SEEN: Counter = Counter()


@pytest.fixture(scope="module")
def api(served):  # noqa: F811
    s = schemathesis.openapi.from_dict(httpx.get(served + "/openapi.json").json())
    s.config.update(base_url=served)
    s.config.generation.update(modes=list(GenerationMode), max_examples=EXAMPLES, deterministic=True)
    return s


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_api_schema(case):
    r = case.call(timeout=CALL_TIMEOUT)
    SEEN[(case.operation.label, r.status_code // 100)] += 1
    assert r.status_code < 500, f"{case.operation.label} {r.status_code}: {r.text[:300]} for {case.body!r:.300}"
    if r.status_code >= 400 and case.operation.path.startswith("/v1/messages"):  # Anthropic's error shape
        body = r.json()
        assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, (r.status_code, body)
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "\n" not in err["message"], err


def test_server_still_answers(served):  # noqa: F811
    """After the fuzzing above: healthy, and a plain request still generates."""
    assert sum(SEEN.values()) >= 7 * EXAMPLES // 2, SEEN  # the fuzzing ran (it is not skipped)
    ok = {label for (label, kind) in SEEN if kind == 2}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/responses",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "GET /tokenizer_info",
    } <= ok, SEEN  # valid bodies got through
    assert any(kind == 4 for _, kind in SEEN), SEEN  # and invalid ones were refused
    assert httpx.get(served + "/health").json()["status"] == "ok"
    r = httpx.post(served + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    print("\nfuzzed:", dict(sorted(SEEN.items())))
