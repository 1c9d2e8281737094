"""Load, soak and faults against a running app through its `ask` API, summed up in one table.

    python -m qvl.stress                        # launches app.py on the tiny model, on a free 127.0.0.1 port
    python -m qvl.stress --backend              # ...and a second app.py in front of it (--backend), asked instead
    python -m qvl.stress --url http://127.0.0.1:7860 --pid PID [--auth user:password]
    python -m qvl.stress --batch 4              # the launched app decodes up to 4 answers together

load: N clients ask at once (two turns each); the first queue_size + batch are answered (in arrival order where
the app answers one at a time), the rest get the busy message; each second turn must report its own conversation's image tokens (so no answer went to the wrong
conversation). soak: a few hundred requests, 4 at a time, a new client (so a new Gradio session) every 5, with the
server's RSS after warm-up and at the end: flat once the app holds --max-sessions sessions (a launched app gets a
small bound, so the soak passes it).
faults: bad uploads and questions, a client that disconnects mid-answer, the cache directory deleted, replaced by a
file and corrupted while serving (when this script launched the app), then SIGTERM. Lost requests (no answer, no
busy message, no input error: a hang, a crash, a dropped connection) must be 0; the exit code says whether they were.
idle (first): the server's CPU time over a minute with nobody asking, after one answered request, as % of one core,
and its threads' wake-ups a second.
With --backend every scenario asks the second app, whose remote engine gets its answers from the first's OpenAI API;
the figures (RSS, idle CPU, the cache damaged) are the second's.
"""
import argparse
import os
import shutil
import signal
import socket
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from gradio_client import Client, handle_file
from PIL import Image

from qvl import settings, texts
from qvl.engine import tiny
from qvl.engine.local import SETTLED

ROOT = Path(__file__).resolve().parents[2]
BUSY = texts.TEXT["en"]["busy"].split("(")[0].strip()  # "The server is busy"
# What the app says when a request went unanswered through no fault of its own (a fault here or in the backend): a
# clear message, but the request is lost, not refused.
FAILED = tuple(texts.TEXT["en"][key].split("{")[0] for key in (
    "failed", "backend_unreachable", "backend_timeout", "backend_cut", "backend_busy", "backend_failed"))
# Sampled, so the tiny model's answers differ by seed and conversation; short, so a request costs well under a second.
ASK = dict(use_cache=True, max_image_tokens=320, max_new_tokens=16, temperature=1.0, top_p=1.0, top_k=200,
           greedy=False, seed=0, max_video_frames=8)
TIMEOUT_S = 300  # one request, queueing included: past this it counts as lost


def ask_data(images: list, question: str, use_cache: bool, **params) -> list:
    """`ask`'s inputs in the raw HTTP API's positional order: ASK's settings, as params change them."""
    return [images, question, use_cache, *[{**ASK, **params}[name] for name in settings.SESSION_PARAMS]]


@dataclass
class Server:
    """An app.py this process launched: its process, address, log file and cache directory."""

    proc: subprocess.Popen
    url: str
    port: int
    log: Path
    cache_dir: Path

    def wait_settled(self, timeout: float = 240):
        """Return once the app says its start's background work is done: until then it compiles numba's kernels
        (18 s on a first start, 2 Zen 3 cores) or repacks, which is start-up, not what an idle server costs."""
        deadline = time.monotonic() + timeout
        while SETTLED not in self.log.read_text(errors="replace"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"app.py did not settle within {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as docker stop or a Space restart sends it; the exit code (killed after timeout: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def launch(model: str, workdir: Path, *flags: str, env: dict | None = None, clean_env: bool = False,
           timeout: float = 240, port: int | None = None) -> Server:
    """Start `python app.py` on model (fp32, its own cache dir, a free port unless given) and return once it serves
    pages.

    env is added to this process's environment, or replaces it with clean_env.
    """
    port, log, cache_dir = port or free_port(), workdir / "server.log", workdir / "answers"
    command = [sys.executable, str(ROOT / "app.py"), "--model", model, "--quant", "fp32", "--port", str(port),
               "--cache-dir", str(cache_dir), *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=(env or {}) if clean_env else {**os.environ, **(env or {})})
    server = Server(proc, f"http://127.0.0.1:{port}/", port, log, cache_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url, timeout=5).status_code < 500:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"app.py did not serve within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def api_ready(url: str, timeout: float = 240):
    """Return once the app's OpenAI API answers: it says 503 until the engine has warmed up, which an app in front
    of it would pass on to its users as the model server being busy."""
    body = {"model": "qvl", "max_tokens": 1, "messages": [{"role": "user", "content": "Ready?"}]}
    deadline = time.monotonic() + timeout
    while httpx.post(url + "v1/chat/completions", json=body, timeout=60).status_code == 503:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}v1 was still warming up after {timeout:.0f} s")
        time.sleep(0.5)


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of the process, all its threads together, and of its children it has waited for."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces: field 3 onwards
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # fields 14-17: utime stime cutime cstime


def picture(path: Path, width_tokens: int = 16, seed: int | None = None) -> Path:
    """A PNG costing exactly width_tokens visual tokens (32 px high); noise when seeded, so it is never cached."""
    size = (32 * width_tokens, 32)
    image = Image.effect_noise(size, 80).convert("RGB") if seed is not None else Image.new("RGB", size, "teal")
    if seed is not None:
        image.putpixel((0, 0), (seed % 256, seed // 256 % 256, 7))
    image.save(path)
    return path


def ask(client: Client, question: str, files=(), **params):
    """Submit one question (with uploads) to the `ask` API; returns gradio_client's Job."""
    return client.submit([handle_file(str(f)) for f in files], question, **{**ASK, **params}, api_name="/ask")


@dataclass
class Tally:
    """What became of the requests of one scenario."""

    name: str
    sent: int = 0
    answered: int = 0
    busy: int = 0
    refused: int = 0  # bad input, told how to fix it: expected in the fault scenario
    wrong: int = 0  # answered, but with another conversation's content or out of arrival order
    latencies: list = field(default_factory=list)
    rss: tuple = (None, None)
    problems: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # soak's workers share one Tally

    @property
    def lost(self) -> int:
        return self.sent - self.answered - self.busy - self.refused

    def outcome(self, job, started: float) -> tuple | None:
        """Wait for job and count it: its (answer, status, boxes) when answered, else None."""
        try:
            result, error = job.result(timeout=TIMEOUT_S), None
        except Exception as e:
            result, error = None, e
        with self.lock:
            self.sent += 1
            if error is None:
                self.answered += 1
                self.latencies.append(time.monotonic() - started)
            elif BUSY in str(error) or "Queue is full" in str(error):
                self.busy += 1
            elif type(error).__name__ == "AppError" and str(error) and not any(f in str(error) for f in FAILED):
                self.refused += 1  # an input error: the message tells the user what to fix
            else:
                self.problems.append(f"{type(error).__name__}: {str(error)[:200]}")
        return result


def image_tokens(status: str) -> int | None:
    """The image-token count in the stats line the API returns with each answer."""
    words = status.split()
    return int(words[words.index("image") - 1]) if "image" in words else None


def wait_until_registered(job, timeout: float = 60):
    """Until the server has this job in hand (in line, answering or done): fixes the arrival order."""
    deadline = time.monotonic() + timeout
    while not job.done() and not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.02)


def load(url: str, n: int, auth, workdir: Path, batch: int = 1) -> Tally:
    """N clients at once, two turns each; client i's image costs 16 + i tokens, which its second turn must report.
    One at a time (batch 1) they are answered in arrival order; answers decoded together end as their lengths say."""
    tally = Tally("load")
    clients = [Client(url, auth=auth, verbose=False) for _ in range(n)]
    try:
        files = [picture(workdir / f"client{i}.png", 16 + i) for i in range(n)]
        jobs, done_at = [], {}
        for i, client in enumerate(clients):
            # Longer answers than ASK's: the order is read from when each client hears its answer is done, and
            # answers that take a few milliseconds end closer together than the clients' threads are scheduled.
            job = ask(client, f"Client {i}: what is in this picture?", [files[i]], seed=i, max_new_tokens=64)
            job.add_done_callback(lambda _, i=i: done_at.setdefault(i, time.monotonic()))
            jobs.append((time.monotonic(), job))
            wait_until_registered(job)
        first = [tally.outcome(job, started) for started, job in jobs]
        answered = [i for i, result in enumerate(first) if result is not None]
        deadline = time.monotonic() + 5  # a job's done callbacks may run just after its result is handed out
        while not set(answered) <= done_at.keys() and time.monotonic() < deadline:
            time.sleep(0.01)
        order = sorted(answered, key=lambda i: done_at.get(i, math.inf))
        if batch == 1 and order != answered:
            tally.wrong += 1
            start = min(done_at.values(), default=0.0)  # none may have been heard: each then ends at +inf
            ends = ", ".join(f"{i} at +{done_at.get(i, math.inf) - start:.3f} s" for i in order)
            tally.problems.append(f"answered out of arrival order: {ends}")
        second = [(i, time.monotonic(), ask(clients[i], "And what else?", seed=i)) for i in answered]
        for i, started, job in second:
            result = tally.outcome(job, started)
            if result is not None and image_tokens(result[1]) != 16 + i:
                tally.wrong += 1
                tally.problems.append(f"client {i}'s second turn reported {result[1]!r}")
    finally:
        for client in clients:
            client.close()
    return tally


def soak(url: str, count: int, auth, pid: int | None, workdir: Path, every: int = 5, workers: int = 4,
         warmup: int = 20) -> Tally:
    """count requests, `workers` at a time; a new client (session) every `every` requests; every 10th repeats the
    worker's first question and picture."""
    tally, numbers, lock = Tally("soak"), iter(range(count)), threading.Lock()
    rss = {}

    def work():
        client, first = None, None
        while True:
            with lock:
                k = next(numbers, None)
                if k == warmup:  # after the first requests have grown every pool and cache they ever will
                    rss["start"] = rss_mb(pid)
            if k is None:
                break
            if client is None or k % every == 0:
                if client:
                    client.close()
                client = Client(url, auth=auth, verbose=False)
            if k % 10 == 9 and first is not None:
                question, files = first
            else:
                question, files = f"Request {k}: describe it.", [picture(workdir / f"soak{k}.png", 16, seed=k)]
                first = first or (question, files)
            started = time.monotonic()
            tally.outcome(ask(client, question, files, seed=0), started)
        if client:
            client.close()

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tally.rss = (rss.get("start"), rss_mb(pid))
    return tally


BAD = {  # file name -> bytes: each must be refused with a message naming the file
    "notes.png": b"not an image, a text file renamed",
    "empty.jpg": b"",
}


def faults(server_url: str, auth, workdir: Path, cache_dir: Path | None) -> Tally:
    """Bad input, a disconnect mid-answer and (for a launched app) a broken cache dir: each followed by a request."""
    tally = Tally("faults")
    client = Client(server_url, auth=auth, verbose=False)
    good = picture(workdir / "good.png", 20)

    def check(question: str, files=(), **params):
        started = time.monotonic()
        return tally.outcome(ask(client, question, files, **params), started)

    def follow_up(what: str):
        if check(f"After {what}: still there?", [good]) is None:
            tally.problems.append(f"the request after {what} was not answered")

    try:
        for name, data in BAD.items():
            (workdir / name).write_bytes(data)
            check("What is this?", [workdir / name])
            follow_up(name)
        jpeg = workdir / "cut.jpg"
        Image.effect_noise((256, 256), 60).convert("RGB").save(jpeg, quality=90)
        jpeg.write_bytes(jpeg.read_bytes()[:2000])
        for what, args in [("a truncated JPEG", ("What is this?", [jpeg])), ("an empty message", ("",)),
                           ("a 200 KB question", ("Read this. " * 20_000,))]:
            check(*args)
            follow_up(what)
        disconnect(server_url, auth)
        follow_up("a client disconnected mid-answer")
        if cache_dir is not None:
            for what, damage in CACHE_DAMAGE.items():
                damage(cache_dir)
                follow_up(f"the cache dir was {what}")
                check("After the damage: the same question again?", [good])  # a would-be hit, never an error
    finally:
        client.close()
    return tally


def _replace_by_file(cache_dir: Path):
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.write_text("not a directory")


def _corrupt(cache_dir: Path):
    if cache_dir.is_file():
        cache_dir.unlink()
    cache_dir.mkdir(exist_ok=True)
    for name in ("cache.db", "cache.db-wal", "cache.db-shm"):
        (cache_dir / name).write_bytes(os.urandom(4096))


# What can happen to the answer cache's directory while the app serves (root ignores permissions, so a file in its
# place stands for "unwritable").
CACHE_DAMAGE = {
    "deleted": lambda cache_dir: shutil.rmtree(cache_dir, ignore_errors=True),
    "replaced by a file": _replace_by_file,
    "corrupted": _corrupt,
}


def disconnect(url: str, auth, after_events: int = 3):
    """Ask for a long answer over the raw HTTP API and drop the connection once it streams, as a closed tab does."""
    with httpx.Client(base_url=url, timeout=60) as http:
        if auth:
            http.post("login", data={"username": auth[0], "password": auth[1]}).raise_for_status()
        data = ask_data([], "Tell me a very long story.", False, max_new_tokens=2000, greedy=True)
        event = http.post("gradio_api/call/ask", json={"data": data}).json()["event_id"]
        with http.stream("GET", f"gradio_api/call/ask/{event}") as stream:
            for n, _ in enumerate(stream.iter_lines()):
                if n >= after_events:
                    break


def wakeups(pid: int) -> int:
    """Context switches of the process's threads so far: each time one of them slept and woke, or was preempted."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # a thread that ended between the listing and the read
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return total


def idle(url: str, auth, pid: int, workdir: Path, seconds: float, settle: float = 2) -> tuple[float, float]:
    """What the server costs over `seconds` with nobody asking, after one answered request: percent of one core, and
    its threads' wake-ups a second. The first is what an idle server takes from the box it shares with its own
    answers; the second is what causes it, and unlike the first it does not scale with the CPU's speed.
    `settle` lets the answer's threads go to sleep."""
    client = Client(url, auth=auth, verbose=False)
    try:
        ask(client, "Warm-up: what is this?", [picture(workdir / "idle.png")]).result(timeout=TIMEOUT_S)
    finally:
        client.close()
    time.sleep(settle)
    used, woken, started = cpu_seconds(pid), wakeups(pid), time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    return 100 * (cpu_seconds(pid) - used) / elapsed, (wakeups(pid) - woken) / elapsed


def cached_repeats(url: str, auth, repeats: int, image: Path) -> list[str]:
    """Cached-repeat latency through the real API: one answer, then `repeats` timed repeats of the same request,
    each a whole client request (the photo uploaded again, the answer streamed back), through gradio_client (which
    polls its stream every 50 ms) and through plain HTTP calls to /gradio_api/call/ask. One line per way."""
    question, lines = "What does this chart show?", []
    client = Client(url, auth=auth, verbose=False)
    first, _, _ = client.predict([handle_file(str(image))], question, **ASK, api_name="/ask")

    def via_client():
        client.predict(api_name="/new_conversation")  # the same question again, not a follow-up
        start = time.perf_counter()
        answer, status, _ = client.predict([handle_file(str(image))], question, **ASK, api_name="/ask")
        return time.perf_counter() - start, answer, status

    with httpx.Client(base_url=url, auth=auth) as http:  # one connection, kept alive, as a client app would

        def via_http():
            start = time.perf_counter()
            with open(image, "rb") as f:
                (path,) = http.post("/gradio_api/upload", files={"files": f}).json()
            upload = {"path": path, "meta": {"_type": "gradio.FileData"}}
            event = http.post("/gradio_api/call/ask", json={"data": ask_data([upload], question, ASK["use_cache"])})
            with http.stream("GET", f"/gradio_api/call/ask/{event.json()['event_id']}") as stream:
                events = list(stream.iter_lines())
            answer, status, _, _ = json.loads(events[events.index("event: complete") + 1].removeprefix("data: "))
            return time.perf_counter() - start, answer, status

        for name, timed in (("gradio_client", via_client), ("HTTP /gradio_api/call/ask", via_http)):
            runs = [timed() for _ in range(repeats)]
            if any(answer != first or "answered from cache" not in status for _, answer, status in runs):
                raise RuntimeError(f"{name}: a repeat was not answered from the cache: {runs[0][1:]}")
            ms = sorted(1000 * seconds for seconds, _, _ in runs)
            lines.append(f"cached repeat via {name}, {repeats} runs: p50 {statistics.median(ms):.0f} ms, p95 "
                         f"{ms[round(0.95 * (repeats - 1))]:.0f} ms (load average {os.getloadavg()[0]:.1f})")
    client.close()
    return lines


def percentile(values: list, q: float) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else None


def table(tallies: list[Tally]) -> str:
    def num(v, unit=""):
        return "-" if v is None else f"{v:.2f}{unit}" if isinstance(v, float) else str(v)

    head = ["scenario", "sent", "answered", "busy", "refused", "lost", "wrong", "p50 s", "p95 s", "RSS start MB",
            "RSS end MB"]
    rows = [[t.name, t.sent, t.answered, t.busy, t.refused, t.lost, t.wrong, percentile(t.latencies, 50),
             percentile(t.latencies, 95), t.rss[0], t.rss[1]] for t in tallies]
    cells = [head] + [[num(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qvl.stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running app; default: launch app.py on the tiny model")
    parser.add_argument("--pid", type=int, help="the running app's process id, for RSS (with --url)")
    parser.add_argument("--auth", default=os.environ.get("QVL_AUTH"), help="user:password [env QVL_AUTH]")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--soak", type=int, default=300)
    parser.add_argument("--new-client-every", type=int, default=5, help="soak requests per client (session)")
    parser.add_argument("--queue-size", type=int, default=settings.Settings.queue_size,
                        help="the launched app's queue bound")
    parser.add_argument("--max-sessions", type=int, default=32,
                        help="the launched app's session bound: above --clients, so the load's conversations are all "
                             "kept, and below the soak's new sessions (soak / new-client-every), so the soak reaches it")
    parser.add_argument("--kv-memory", default="16MB",
                        help="the launched app's bound on kept conversations: small, so the soak reaches it and its "
                             "RSS shows the bound at work (with --backend, the first app's: the model's)")
    parser.add_argument("--batch", type=int, default=1, choices=range(1, 9), metavar="1-8",
                        help="the launched app's --batch: answers decoded together (the app holding the model, with "
                        "--backend); with --url, the running app's, for the load's order check")
    parser.add_argument("--backend", action="store_true",
                        help="launch a second app.py with --backend in front of the first and run everything through "
                             "the second, so that its remote engine answers")
    parser.add_argument("--idle", type=float, default=60,
                        help="seconds over which to measure the server's CPU use and wake-ups while idle, after one "
                             "answered request, before the other scenarios (needs the pid; 0 skips it)")
    parser.add_argument("--cached-repeats", type=int, default=0,
                        help="time this many cached repeats of one request through the API, before the load "
                             "(0 skips it)")
    args = parser.parse_args(argv)
    auth = tuple(args.auth.split(":", 1)) if args.auth else None
    workdir = Path(tempfile.mkdtemp(prefix="qvl-stress-"))
    server = backend = None  # the app asked; with --backend, the one holding the model behind it
    try:
        if args.url:
            url, pid, cache_dir = args.url, args.pid, None
        else:
            model = tiny.build(workdir / "tiny")
            env = {"QVL_AUTH": args.auth} if args.auth else {}
            engine_flags = ("--kv-memory", args.kv_memory, "--batch", str(args.batch))
            engine = f"on the tiny model, {args.kv_memory} of kept conversations, batch {args.batch}"
            if args.backend:
                (workdir / "backend").mkdir()
                backend = launch(str(model), workdir / "backend", *engine_flags)
                api_ready(backend.url)
                print(f"launched app.py (pid {backend.proc.pid}) at {backend.url} {engine}, as the backend", flush=True)
                engine_flags = ("--backend", backend.url + "v1", "--concurrency", str(args.batch))
                engine = f"in front of it (--backend {backend.url}v1)"
            server = launch(str(model), workdir, "--queue-size", str(args.queue_size),
                            "--max-sessions", str(args.max_sessions), *engine_flags, env=env)
            url, pid, cache_dir = server.url, server.proc.pid, server.cache_dir
            print(f"launched app.py (pid {pid}) at {url} {engine}, queue size {args.queue_size}, "
                  f"{args.max_sessions} sessions", flush=True)
        if server is not None:  # with --backend, the app holding the model is the one with background work
            (backend or server).wait_settled()
        idled = idle(url, auth, pid, workdir, args.idle) if args.idle and pid else None
        if idled is not None:
            print("idle done", flush=True)
        # Before the faults scenario, which breaks the cache folder on purpose.
        repeats = cached_repeats(url, auth, args.cached_repeats, ROOT / "assets" / "chart.png") \
            if args.cached_repeats else []
        tallies = []
        for run in (lambda: load(url, args.clients, auth, workdir, args.batch),
                    lambda: soak(url, args.soak, auth, pid, workdir, args.new_client_every),
                    lambda: faults(url, auth, workdir, cache_dir)):
            tallies.append(run())
            print(f"{tallies[-1].name} done", flush=True)
        print(table(tallies))
        if idled is not None:
            print(f"idle: {idled[0]:.2f}% of one core, {idled[1]:.0f} wake-ups a second, over {args.idle:.0f} s")
        for line in repeats:
            print(line)
        for t in tallies:
            for problem in t.problems[:10]:
                print(f"{t.name}: {problem}")
        healthy = all(t.lost == 0 and t.wrong == 0 and not t.problems for t in tallies)
        # The app asked first, then the backend it may still be asking.
        for what, launched in (("SIGTERM", server), ("SIGTERM to the backend", backend)):
            if launched is not None:
                code = launched.stop()
                freed = port_free(launched.port)
                print(f"{what}: exit code {code}, port {launched.port} {'freed' if freed else 'STILL IN USE'}")
                healthy = healthy and code == 0 and freed
        return 0 if healthy else 1
    finally:
        for launched in (server, backend):
            if launched is not None:
                launched.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
