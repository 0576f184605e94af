"""The CLI client's own HTTP (cli/transport.py) against a scripted loopback server: framing,
connection reuse, an agent that closed an idle connection, timeouts, answers that are not the API's,
URLs that cannot work. The API itself is tested through the real server in test_cli_client."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from nodeagent.cli.client import AgentClient, AgentUnreachable
from nodeagent.errors import NodeAgentError

TOKEN = "natest-transport-token"
SLOTS = json.dumps({"slots": [{"id": "s1", "name": "a"}]}).encode()


def http_answer(body: bytes, status: str = "200 OK", content_type: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class ScriptedAgent:
    """Accepts connections one after another and answers each request with ``answer(request_line)``;
    None means never answer. ``close_after_answer``: hang up after each answer, as an agent does
    with a keep-alive connection that stayed idle too long."""

    def __init__(self, answer: Callable[[str], bytes | None], *, close_after_answer: bool = False) -> None:
        self.answer = answer
        self.close_after_answer = close_after_answer
        self.request_lines: list[str] = []
        self.connections = 0
        self.hung_up = threading.Event()
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                self.connections += 1
                self._converse(conn)

    def _converse(self, conn: socket.socket) -> None:
        buffered = b""
        while not self.stopping.is_set():
            while b"\r\n\r\n" not in buffered:
                chunk = conn.recv(65536)
                if not chunk:
                    return  # the client hung up
                buffered += chunk
            head, _, buffered = buffered.partition(b"\r\n\r\n")
            self.request_lines.append(head.split(b"\r\n")[0].decode())
            reply = self.answer(self.request_lines[-1])
            if reply is None:
                self.stopping.wait()
                return
            conn.sendall(reply)
            if self.close_after_answer:
                conn.shutdown(socket.SHUT_RDWR)
                self.hung_up.set()
                return


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedAgent]]:
    started: list[ScriptedAgent] = []

    def start(answer: Callable[[str], bytes | None], **kwargs: bool) -> ScriptedAgent:
        started.append(ScriptedAgent(answer, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def test_one_connection_serves_several_requests(scripted: Callable[..., ScriptedAgent]) -> None:
    agent = scripted(lambda line: http_answer(SLOTS))
    with AgentClient(agent.url, TOKEN) as client:
        assert [client.list_slots() for _ in range(3)] == [[{"id": "s1", "name": "a"}]] * 3
    assert (agent.connections, len(agent.request_lines)) == (1, 3)


def test_a_get_gives_the_answer_as_it_came(scripted: Callable[..., ScriptedAgent]) -> None:
    agent = scripted(lambda line: http_answer(SLOTS))
    with AgentClient(agent.url, TOKEN) as client:
        answer = client.get("/v1/slots", query={"state": "ready"})
    assert (answer.status, answer.json()) == (200, {"slots": [{"id": "s1", "name": "a"}]})
    assert agent.request_lines == ["GET /v1/slots?state=ready HTTP/1.1"]


def test_a_connection_the_agent_closed_is_replaced(scripted: Callable[..., ScriptedAgent]) -> None:
    agent = scripted(lambda line: http_answer(SLOTS), close_after_answer=True)
    with AgentClient(agent.url, TOKEN) as client:
        client.list_slots()
        assert agent.hung_up.wait(timeout=10)
        assert client.list_slots() == [{"id": "s1", "name": "a"}]
    assert agent.connections == 2


def test_an_agent_that_does_not_answer_times_out(scripted: Callable[..., ScriptedAgent]) -> None:
    agent = scripted(lambda line: None)
    with (
        AgentClient(agent.url, TOKEN, timeout=0.2) as client,
        pytest.raises(AgentUnreachable, match=r"did not answer GET /v1/slots in time \(ReadTimeout\)"),
    ):
        client.list_slots()


def test_the_url_path_prefixes_every_request_and_queries_are_encoded(
    scripted: Callable[..., ScriptedAgent],
) -> None:
    agent = scripted(lambda line: http_answer(json.dumps({"lines": ["x"]}).encode()))
    with AgentClient(agent.url + "/behind/proxy/", TOKEN) as client:
        assert client.logs("web-1", 2) == ["x"]
    assert agent.request_lines == ["GET /behind/proxy/v1/slots/web-1/logs?lines=2 HTTP/1.1"]


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        pytest.param(
            http_answer(b"<html>hello</html>", content_type="text/html"),
            "answered GET /v1/slots with HTTP 200 but not JSON; is 127.0.0.1 a nodeagent?",
            id="not-json",
        ),
        pytest.param(
            http_answer(b"upstream down", "502 Bad Gateway", "text/plain"),
            "the agent answered HTTP 502 Bad Gateway",
            id="error-without-the-apis-body",
        ),
        pytest.param(
            http_answer(b"[1, 2]"), "answered with list, expected a JSON object", id="not-an-object"
        ),
    ],
)
def test_answers_that_are_not_the_apis(
    scripted: Callable[..., ScriptedAgent], reply: bytes, message: str
) -> None:
    agent = scripted(lambda line: reply)
    with AgentClient(agent.url, TOKEN) as client, pytest.raises(NodeAgentError) as raised:
        client.list_slots()
    assert message in str(raised.value)
    assert type(raised.value) is NodeAgentError


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("127.0.0.1:7070", "Request URL is missing an 'http://' or 'https://' protocol."),
        ("localhost:7070", "Request URL has an unsupported protocol 'localhost://'."),
        ("ftp://127.0.0.1", "Request URL has an unsupported protocol 'ftp://'."),
        ("http://127.0.0.1:port", "the URL's port is not valid"),
        ("http://:7070", "the URL names no host"),
    ],
)
def test_urls_that_cannot_work_say_so(url: str, reason: str) -> None:
    with AgentClient(url, TOKEN) as client, pytest.raises(AgentUnreachable) as raised:
        client.list_slots()
    assert str(raised.value).startswith(f"cannot reach the agent at {url}: {reason}")


def chunked(body: bytes) -> bytes:
    half = len(body) // 2
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{half:x};ext=1\r\n".encode() + body[:half] + b"\r\n"
        + f"{len(body) - half:X}\r\n".encode() + body[half:] + b"\r\n"
        + b"0\r\nX-Trailer: ignored\r\n\r\n"
    )  # fmt: skip


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
CLOSING = http_answer(SLOTS).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
HTTP_1_0 = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"


@pytest.mark.parametrize(
    ("reply", "agent_hangs_up", "connections"),
    [
        pytest.param(chunked(SLOTS), False, 1, id="chunked"),
        pytest.param(EARLY_HINTS + http_answer(SLOTS), False, 1, id="1xx-first"),
        pytest.param(CLOSING, False, 2, id="connection-close"),  # the client must hang up itself
        pytest.param(HTTP_1_0 + SLOTS, True, 2, id="http-1.0-until-the-end"),
    ],
)
def test_answer_framings(
    scripted: Callable[..., ScriptedAgent], reply: bytes, agent_hangs_up: bool, connections: int
) -> None:
    agent = scripted(lambda line: reply, close_after_answer=agent_hangs_up)
    with AgentClient(agent.url, TOKEN) as client:
        assert [client.list_slots(), client.list_slots()] == [[{"id": "s1", "name": "a"}]] * 2
    assert agent.connections == connections


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + SLOTS[:10],
            "the connection was closed 10 bytes into a 100-byte answer",
            id="cut-short",
        ),
        pytest.param(
            b"SSH-2.0-OpenSSH_9.2\r\n", "does not start with an HTTP/1.x status line", id="not-http"
        ),
        pytest.param(b"", "the connection was closed before an answer came", id="hung-up"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "malformed chunk size",
            id="bad-chunk",
        ),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n{}",
            "unusable Content-Length",
            id="two-lengths",
        ),
    ],
)
def test_answers_that_are_not_http_make_the_agent_unreachable(
    scripted: Callable[..., ScriptedAgent], reply: bytes, reason: str
) -> None:
    agent = scripted(lambda line: reply, close_after_answer=True)
    with AgentClient(agent.url, TOKEN) as client, pytest.raises(AgentUnreachable) as raised:
        client.list_slots()
    assert str(raised.value).startswith(f"cannot reach the agent at {agent.url}: ")
    assert reason in str(raised.value)
