"""Chat templates sent by clients render in worker processes that can be killed.

The sandbox (chat_template.py) counts a template's loops, calls and output and stops it from the
inside, but one built-in call runs to its end without counting anything: `lipsum(n=10**8)`, a
`'%*s'` width given as an argument, `wordwrap` of a huge string. In a thread such a call cannot be
stopped, holds its memory, and keeps the process from exiting. So a template that came with a
request (`--allow-request-chat-template`) renders in a worker process instead, whose address space
is capped (`MEMORY_LIMIT`): past the time limit the worker is killed and replaced, past the memory
cap its allocation fails, and either way the request is refused with the limit it went over. The
model's own template, chosen by the operator and probed at start-up, renders in the caller's thread.

Workers are fresh interpreters (`python -m cadence.model.template_process`: never forked from a
process running torch's and the server's threads, and never re-running the caller's main module as
multiprocessing's spawn would), import only the template code, and are kept for the next render;
at most `WORKERS` render at once, the rest wait their turn.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from cadence.model.chat_template import RenderedChat
from cadence.model.template_limits import ChatTemplateLimitError, RenderLimits

WORKERS = 2
MEMORY_LIMIT = 1 << 30  # bytes of address space of a worker: the interpreter, jinja2 and one render
GRACE = 1.0  # seconds past the render's own time limit before its worker is killed
_START_TIMEOUT = 60.0  # a worker's first answer (spawning and importing) on a loaded machine


def _serve(recv: Connection, send: Connection, memory_limit: int) -> None:
    """A worker: render the jobs it is sent, one at a time, until its pipe closes."""
    import resource

    from cadence.model.chat_template import render_chat

    with contextlib.suppress(ValueError, OSError):  # a platform without the cap: time still bounds a render
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    send.send(("ready", None))
    while True:
        try:
            source, messages, add_generation_prompt, variables, limits = recv.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", render_chat(source, messages, add_generation_prompt, variables, limits))
        except ChatTemplateLimitError as e:
            reply = ("limit", (e.what, e.option))
        except MemoryError:
            reply = ("limit", (f"needed more than {memory_limit >> 20} MiB of memory", None))
        except ValueError as e:
            reply = ("value", str(e))
        except Exception as e:  # a template may raise anything its sandbox lets through
            reply = ("value", f"chat template failed: {type(e).__name__}: {e}")
        send.send(reply)


class _Worker:
    def __init__(self, memory_limit: int) -> None:
        job_r, job_w = os.pipe()
        reply_r, reply_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cadence.model.template_process", str(job_r), str(reply_w), str(memory_limit)],
            pass_fds=(job_r, reply_w), env=env, stdin=subprocess.DEVNULL, close_fds=True,
        )
        os.close(job_r)
        os.close(reply_w)
        self.jobs = Connection(job_w, readable=False)
        self.replies = Connection(reply_r, writable=False)
        if not self.replies.poll(_START_TIMEOUT) or self.replies.recv()[0] != "ready":
            self.kill()
            raise RuntimeError("a chat-template worker process did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(5)
        self.jobs.close()
        self.replies.close()


class TemplateProcesses:
    """A small pool of render workers; `render` is thread-safe."""

    def __init__(self, workers: int = WORKERS, memory_limit: int = MEMORY_LIMIT) -> None:
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._memory_limit = memory_limit
        self._closed = False

    def render(self, source: str, messages: Any, add_generation_prompt: bool, variables: Mapping[str, Any],
               limits: RenderLimits) -> RenderedChat:
        """`chat_template.render_chat` in a worker; ChatTemplateLimitError past the time or memory cap."""
        with self._slots:
            worker = self._take()
            try:
                worker.jobs.send((source, messages, add_generation_prompt, dict(variables), limits))
                if not worker.replies.poll(limits.timeout + GRACE):
                    raise ChatTemplateLimitError(f"ran longer than {limits.timeout:g} s", "chat_template_timeout")
                status, value = worker.replies.recv()
            except ChatTemplateLimitError:
                worker.kill()
                raise
            except (EOFError, OSError):  # the worker died: its memory cap, most likely
                worker.kill()
                raise ChatTemplateLimitError(
                    f"made its render process fail (more than {self._memory_limit >> 20} MiB of memory?)", None,
                ) from None
            if status == "limit":  # it may have grown to its cap: a fresh worker for the next render
                worker.kill()
            else:
                self._give_back(worker)
        if status == "ok":
            return value
        if status == "limit":
            raise ChatTemplateLimitError(*value)
        raise ValueError(value)

    def _take(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Worker(self._memory_limit)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


_POOL: TemplateProcesses | None = None
_POOL_LOCK = threading.Lock()


def template_processes() -> TemplateProcesses:
    """The process-wide pool, started on first use and closed at exit."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = TemplateProcesses()
            atexit.register(_POOL.close)
        return _POOL


if __name__ == "__main__":  # a worker: python -m cadence.model.template_process JOB_FD REPLY_FD MEMORY_LIMIT
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
           int(sys.argv[3]))
