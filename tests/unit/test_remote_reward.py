"""``reward.remote``: a reward server over HTTP in OpenRLHF's protocol, against a local server made here."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hybrid_rl.config.algorithm import RemoteRewardConfig
from hybrid_rl.rewards import RewardError
from hybrid_rl.rewards.remote import RemoteReward


class _Server:
    """A reward server: the reward is the response's length; ``mode`` makes it fail in one of several ways."""

    def __init__(self, mode: str = "ok"):
        self.mode, self.requests = mode, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                if outer.mode == "500":
                    self.send_response(500)
                    self.end_headers()
                    return
                rewards = [float(len(r)) for r in body["responses"]]
                if outer.mode == "short":
                    rewards = rewards[:-1]
                data = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    s = _Server(getattr(request, "param", "ok"))
    yield s
    s.close()


def _cfg(url, **kw):
    cfg = RemoteRewardConfig(url=url, batch_size=3, max_concurrency=2, timeout_s=5, retries=1, **kw)
    cfg.validate()
    return cfg


def test_each_sample_gets_the_servers_reward_in_order(server):
    prompts = [f"<p{i}>" for i in range(7)]
    responses = ["a" * i for i in range(7)]
    labels = [str(i) for i in range(7)]
    scores, failed = RemoteReward(_cfg(server.url)).score(prompts, responses, labels)
    assert scores == [float(i) for i in range(7)] and failed == 0
    assert sorted(len(r["query"]) for r in server.requests) == [1, 3, 3]  # chunks of batch_size
    sent = {p: (q, r, lab) for req in server.requests
            for q, p, r, lab in zip(req["query"], req["prompts"], req["responses"], req["labels"])}
    assert sent == {p: (p + r, r, lab) for p, r, lab in zip(prompts, responses, labels)}


@pytest.mark.parametrize("server, words", [("500", "HTTP 500"), ("short", "no list 'rewards' of 3 numbers")],
                         indirect=["server"])
def test_a_failing_server_is_one_line_or_counted_zeros(server, words):
    remote = RemoteReward(_cfg(server.url))
    with pytest.raises(RewardError) as ei:
        remote.score(["p"] * 3, ["r"] * 3, ["l"] * 3)
    msg = str(ei.value)
    assert msg.startswith(f"reward.remote.url={server.url!r}: ") and words in msg and "after 2 tries" in msg
    assert "\n" not in msg and len(server.requests) == 2  # one retry
    assert remote.score(["p"] * 4, ["r"] * 4, ["l"] * 4, on_error="zero") == ([0.0] * 4, 4)


def test_no_server_and_a_bad_url():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RewardError) as ei:
        RemoteReward(_cfg(f"http://127.0.0.1:{port}/get_reward")).score(["p"], ["r"], ["l"])
    assert "cannot connect" in str(ei.value)
    with pytest.raises(RewardError) as ei:
        RemoteReward(_cfg("localhost:5000"))
    assert "is not an http:// or https:// URL" in str(ei.value)
